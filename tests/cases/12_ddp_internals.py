"""Chapter 12: the classic ways to get a hand-made, overlapping DDP wrong, each of which the lab's
check must name."""

from mutation import Mutation, Variant


# launch_bucket's buffer through finish_gradient_sync's division (DDP's order changes both ends)
LAUNCH_TO_WAIT = ('        grads = [p.grad if p.grad is not None else torch.zeros_like(p)\n'
                  '                 for p in (self.params[i] for i in self.buckets[bucket])]\n'
                  '        flat = torch.cat([g.reshape(-1) for g in grads])\n'
                  '        work = dist.all_reduce(flat, async_op=True)\n'
                  '        self.pending.append((work, flat, bucket))\n'
                  '        # END SOLUTION\n'
                  '\n'
                  '    def finish_gradient_sync(self) -> None:\n'
                  '        """Call after the last backward of a window (one that reduced), before optimizer.step().\n'
                  '        The contract: when it returns, every bucket has been all-reduced exactly once in this\n'
                  "        backward, in index order; every reduced parameter's .grad holds the average over all ranks\n"
                  '        of its gradient (a parameter that had no .grad gets one); and the object is ready for the\n'
                  '        next window\'s backward."""\n'
                  "        # HINT 1: a parameter that got no gradient never completes its bucket, nor lets the buckets after it go out: those are still waiting here. An async all-reduce's buffer holds the sum only once its Work's wait() has returned.\n"
                  "        # HINT 2: launch the buckets still waiting, in order; then for each launched all-reduce: wait, divide the buffer by the world size, copy each parameter's slice back into its .grad; last, reset what the hook counted.\n"
                  '        # HINT 3: offset = 0; for i in self.buckets[bucket]: p = self.params[i]; average = flat[offset:offset + p.numel()].view_as(p); p.grad.copy_(average) (or p.grad = average.clone() when None); offset += p.numel()\n'
                  '        # BEGIN SOLUTION: make every reduced .grad the average over all ranks, each bucket all-reduced exactly once and in index order, then leave the object ready for the next window\n'
                  '        while self.launched < len(self.buckets):\n'
                  '            self.launch_bucket(self.launched)\n'
                  '            self.launched += 1\n'
                  '        world_size = dist.get_world_size()\n'
                  '        for work, flat, bucket in self.pending:\n'
                  '            work.wait()\n'
                  '            flat /= world_size\n')

CORRECT = [
    # REVIEW F: rejected as "0 all-reduces ... with sync on again" (the recorder saw dist.all_reduce only)
    Variant("all_reduce imported by name",
            "        work = dist.all_reduce(flat, async_op=True)\n",
            "        from torch.distributed import all_reduce\n        work = all_reduce(flat, async_op=True)\n", 2),
    # REVIEW 4, A: waiting through get_future().wait(), chapter 12's own idiom, was "never waited"
    Variant("waiting through the all-reduce's future",
            "        work = dist.all_reduce(flat, async_op=True)\n",
            "        work = dist.all_reduce(flat, async_op=True).get_future()\n", 2),
    # REVIEW 4, 12 item 8: DDP's own order - persistent bucket buffers, divided before the all-reduce
    Variant("persistent bucket buffers, divided before the all-reduce", LAUNCH_TO_WAIT,
            ('        if getattr(self, "bucket_buffers", None) is None:  # one persistent buffer per bucket, as DDP keeps\n'
             '            self.bucket_buffers = [torch.empty(sum(self.params[i].numel() for i in b), device=self.params[b[0]].device)\n'
             '                            for b in self.buckets]\n'
             '        flat, offset = self.bucket_buffers[bucket], 0\n'
             '        for i in self.buckets[bucket]:\n'
             '            p = self.params[i]\n'
             '            piece = flat[offset:offset + p.numel()]\n'
             '            piece.copy_(p.grad.reshape(-1)) if p.grad is not None else piece.zero_()\n'
             '            offset += p.numel()\n'
             '        flat.div_(dist.get_world_size())  # DDP divides before the all-reduce\n'
             '        work = dist.all_reduce(flat, async_op=True)\n'
             '        self.pending.append((work, flat, bucket))\n'
             '        # END SOLUTION\n'
             '\n'
             '    def finish_gradient_sync(self) -> None:\n'
             '        """Call after the last backward of a window (one that reduced), before optimizer.step().\n'
             '        The contract: when it returns, every bucket has been all-reduced exactly once in this\n'
             "        backward, in index order; every reduced parameter's .grad holds the average over all ranks\n"
             '        of its gradient (a parameter that had no .grad gets one); and the object is ready for the\n'
             '        next window\'s backward."""\n'
             "        # HINT 1: a parameter that got no gradient never completes its bucket, nor lets the buckets after it go out: those are still waiting here. An async all-reduce's buffer holds the sum only once its Work's wait() has returned.\n"
             "        # HINT 2: launch the buckets still waiting, in order; then for each launched all-reduce: wait, divide the buffer by the world size, copy each parameter's slice back into its .grad; last, reset what the hook counted.\n"
             '        # HINT 3: offset = 0; for i in self.buckets[bucket]: p = self.params[i]; average = flat[offset:offset + p.numel()].view_as(p); p.grad.copy_(average) (or p.grad = average.clone() when None); offset += p.numel()\n'
             '        # BEGIN SOLUTION: make every reduced .grad the average over all ranks, each bucket all-reduced exactly once and in index order, then leave the object ready for the next window\n'
             '        while self.launched < len(self.buckets):\n'
             '            self.launch_bucket(self.launched)\n'
             '            self.launched += 1\n'
             '        world_size = dist.get_world_size()\n'
             '        for work, flat, bucket in self.pending:\n'
             '            work.wait()\n'), 2),
    Variant("a future chained with .then, its value read in finish_gradient_sync",
            "        work = dist.all_reduce(flat, async_op=True)\n",
            "        work = dist.all_reduce(flat, async_op=True).get_future().then(lambda done: done.value()[0])\n", 2),
    Variant("every pending all-reduce waited at once with torch.futures.wait_all",
            "        for work, flat, bucket in self.pending:\n            work.wait()\n",
            "        torch.futures.wait_all([work.get_future() for work, _, _ in self.pending])\n"
            "        for work, flat, bucket in self.pending:\n", 2),
    Variant("the buckets in line launched by a for loop with break",
            "        while (self.launched < len(self.buckets)\n"
            "               and self.ready[self.launched] == len(self.buckets[self.launched])):\n"
            "            self.launch_bucket(self.launched)\n            self.launched += 1\n        # END SOLUTION\n",
            "        for b in range(self.launched, len(self.buckets)):\n"
            "            if self.ready[b] < len(self.buckets[b]):\n                break\n"
            "            self.launch_bucket(b)\n            self.launched = b + 1\n        # END SOLUTION\n", 2),
]

MUTATIONS = [
    # REVIEW 6: right on gloo, wrong on a GPU: seen on the stand-in GPU (ringside.standin)
    Mutation("bucket buffer made on the CPU", "        flat = torch.cat([g.reshape(-1) for g in grads])\n",
             "        flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype)\n"
             "        torch.cat([g.reshape(-1) for g in grads], out=flat)\n",
             "HandDDP, run as on a GPU machine", 2),
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
    # REVIEW 4, 12 item 6: at most one bucket launched per arriving gradient passed (no bucket completed
    # out of order with its turn coming during backward); the check's OutOfOrder model has one
    Mutation("if instead of while: at most one bucket launched per gradient",
             "        while (self.launched < len(self.buckets)\n",
             "        if (self.launched < len(self.buckets)\n",
             "launch every following bucket that is already complete"),
    # REVIEW 4, 12 item 8: the hook's counters never reset, only the pending list
    Mutation("only the pending list reset after a window",
             "        self.ready = [0] * len(self.buckets)\n        self.launched = 0\n        self.pending = []\n",
             "        self.pending = []\n",
             "is all of its state reset after each window"),
    Mutation("the last bucket dropped when it is not full", "    if current:\n        buckets.append(current)\n", "",
             "keep the one still being filled"),
    # REVIEW 5, m3: the forward outside no_sync(), the backward inside: DDP decides at the forward, so the
    # backward reduces; it was named as a hook that reduces inside no_sync()
    Mutation("train_window: the forward outside no_sync(), only the backward inside",
             "        with model.no_sync():\n            loss_of(model, batch).backward()\n",
             "        loss = loss_of(model, batch)\n        with model.no_sync():\n            loss.backward()\n",
             "forward AND backward inside", 2),
]
