"""Chapter 12: the classic ways to get a hand-made, overlapping DDP wrong, each of which the lab's
check must name."""

from mutation import Mutation, Variant

NPROCS = (2, 4)

CORRECT = [
    # REVIEW F: rejected as "0 all-reduces ... with sync on again" (the recorder saw dist.all_reduce only)
    Variant("all_reduce imported by name",
            "        work = dist.all_reduce(flat, async_op=True)\n",
            "        from torch.distributed import all_reduce\n        work = all_reduce(flat, async_op=True)\n", 2),
]

MUTATIONS = [
    Mutation("buckets in forward order",
             "    for index in reversed(range(len(params))):\n",
             "    for index in range(len(params)):\n",
             "buckets in forward order"),
    Mutation("a parameter never reduced (off-by-one reversed range)",
             "    for index in reversed(range(len(params))):\n",
             "    for index in range(len(params) - 1, 0, -1):\n",
             "are in no bucket, so their gradients are never averaged"),
    Mutation("cap read as megabytes: one bucket",
             "        if size >= cap:\n",
             "        if size >= cap * 2**20:\n",
             "one bucket for everything"),
    Mutation("waiting inside the hook",
             "        self.pending.append((work, flat, bucket))\n",
             "        work.wait()\n        self.pending.append((work, flat, bucket))\n",
             "waiting inside the hook stalls backward"),
    Mutation("blocking all_reduce in the hook",
             "        work = dist.all_reduce(flat, async_op=True)\n",
             "        work = dist.all_reduce(flat)\n",
             "called without async_op=True"),
    Mutation("dividing twice",
             "        work = dist.all_reduce(flat, async_op=True)\n",
             "        flat /= dist.get_world_size()\n        work = dist.all_reduce(flat, async_op=True)\n",
             "divided by world_size twice"),
    Mutation("never dividing",
             "            flat /= world_size\n",
             "",
             "never divided by the world size"),
    Mutation("reducing during accumulation",
             "        self.sync = False\n        try:\n",
             "        try:\n",
             "reducing during accumulation"),
    Mutation("last micro-batch inside no_sync",
             "    loss_of(model, micro_batches[-1]).backward()\n",
             "    with model.no_sync():\n        loss_of(model, micro_batches[-1]).backward()\n",
             "must run outside no_sync()"),
    Mutation("sync not switched back on",
             "        finally:\n            self.sync = True\n",
             "        finally:\n            pass\n",
             "with sync on again"),
    Mutation("ready counts never reset",
             "        self.ready = [0] * len(self.buckets)\n        self.launched = 0\n",
             "        self.launched = 0\n",
             "is what the hook counts (gradients arrived per bucket) reset"),
    Mutation("never waiting before the step",
             "            work.wait()\n            flat /= world_size\n",
             "            flat /= world_size\n",
             "never waited"),
    Mutation("pending list never emptied",
             "        self.pending = []\n        # END SOLUTION\n",
             "        # END SOLUTION\n",
             "forget the all-reduces already waited on after each window"),
    Mutation("step before finish_gradient_sync",
             "    if isinstance(model, HandDDP):\n        model.finish_gradient_sync()\n    optimizer.step()\n",
             "    optimizer.step()\n    if isinstance(model, HandDDP):\n        model.finish_gradient_sync()\n",
             "call finish_gradient_sync() before optimizer.step()"),
    Mutation("averaged slice never copied back (rebinding instead of copy_)",
             "                    p.grad.copy_(average)\n",
             "                    grad = average\n",
             "never copied back into .grad"),
    Mutation("no zero_grad after the step",
             "    optimizer.step()\n    optimizer.zero_grad()\n",
             "    optimizer.step()\n",
             "are the gradients zeroed", 3),
    Mutation("buffer divided before its all-reduce finished",
             "            work.wait()\n            flat /= world_size\n",
             "            flat /= world_size\n            work.wait()\n",
             "before its work.wait() returns", 3),
    # Beyond the lab's own model (the check's Probe: layers registered in another order than used,
    # a frozen bias, an unused layer, a BatchNorm, other weights on every rank)
    Mutation("buckets launched in completion order, not index order",
             "        self.ready[self.bucket_of[index]] += 1\n"
             "        while (self.launched < len(self.buckets)\n"
             "               and self.ready[self.launched] == len(self.buckets[self.launched])):\n"
             "            self.launch_bucket(self.launched)\n",
             "        bucket = self.bucket_of[index]\n"
             "        self.ready[bucket] += 1\n"
             "        if self.ready[bucket] == len(self.buckets[bucket]):\n"
             "            self.launch_bucket(bucket)\n",
             "launch bucket i only after buckets 0..i-1", 3),
    Mutation("buckets left waiting by an unused parameter never launched",
             "        while self.launched < len(self.buckets):\n"
             "            self.launch_bucket(self.launched)\n"
             "            self.launched += 1\n"
             "        world_size = dist.get_world_size()\n",
             "        world_size = dist.get_world_size()\n",
             "must launch the buckets still waiting"),
    Mutation("a missing gradient not counted as zeros",
             "        grads = [p.grad if p.grad is not None else torch.zeros_like(p)\n"
             "                 for p in (self.params[i] for i in self.buckets[bucket])]\n",
             "        grads = [p.grad for p in (self.params[i] for i in self.buckets[bucket])]\n",
             "it counts as zeros in its bucket"),
    Mutation("an unused parameter's .grad never created",
             "                if p.grad is None:\n"
             "                    p.grad = average.clone()\n"
             "                else:\n"
             "                    p.grad.copy_(average)\n",
             "                p.grad.copy_(average)\n",
             "gets the averaged slice as a new .grad"),
    Mutation("no_sync decided at the backward (the hook reads self.sync)",
             "        if not self.reduce_this_backward:\n            return\n",
             "        if not self.sync:\n            return\n",
             "it decides at the forward", 3),
    Mutation("a bucket exactly at the cap left open (> instead of >=)",
             "        if size >= cap:\n",
             "        if size > cap:\n",
             "close it at size >= cap, not > cap"),
    Mutation("self.launched never reset after a window",
             "        self.ready = [0] * len(self.buckets)\n        self.launched = 0\n        self.pending = []\n",
             "        self.ready = [0] * len(self.buckets)\n        self.pending = []\n",
             "does the hook start again from bucket 0 in every window", 3),
    Mutation("a gradient counted in the wrong bucket (by parameter index)",
             "        self.ready[self.bucket_of[index]] += 1\n",
             "        self.ready[min(index, len(self.buckets) - 1)] += 1\n",
             "is each gradient counted in the bucket that holds it", 3),
    Mutation("a bucket launched when its first gradient arrives",
             "               and self.ready[self.launched] == len(self.buckets[self.launched])):\n",
             "               and self.ready[self.launched] >= 1):\n",
             "a bucket is complete only once every gradient it holds is ready"),
    Mutation("bucket buffer filled with the weights, not the gradients",
             "        grads = [p.grad if p.grad is not None else torch.zeros_like(p)\n",
             "        grads = [p.detach() if p.grad is not None else torch.zeros_like(p)\n",
             "did not carry this rank's gradients"),
    # found by trying mistakes not planted at 2, 3 and 4 ranks: the check never raised inside the block
    Mutation("no_sync() without finally: an exception leaves sync off",
             "        self.sync = False\n        try:\n            yield\n        finally:\n            self.sync = True\n",
             "        self.sync = False\n        yield\n        self.sync = True\n",
             "turn sync back on however its block ends"),
]
