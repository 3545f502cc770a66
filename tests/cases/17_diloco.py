"""Chapter 17: the mistakes of DiLoCo's outer step by hand, each of which the lab's check must name."""

from mutation import Mutation, Variant

NPROCS = (1, 2, 3, 4, 5)

MUTATIONS = [
    # REVIEW 6: right on gloo, wrong on a GPU: seen on the stand-in GPU (ringside.standin)
    Mutation("momentum buffers made without device=", "        self.buffers = [torch.zeros_like(p) for p in self.params]\n",
             "        self.buffers = [torch.zeros(p.shape, dtype=p.dtype) for p in self.params]\n",
             "DiLoCo, run as on a GPU machine", 2),
    # REVIEW 6: the sign of the momentum term
    Mutation("momentum term subtracted", "            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)\n",
             "            anchor.sub_(g.add(buf, alpha=-self.momentum), alpha=self.lr)\n",
             "the momentum term has the wrong sign", 2),
    Mutation("pseudo-gradient's sign flipped", "    flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)])\n",
             "    flat = torch.cat([(p.detach() - a).reshape(-1) for a, p in zip(anchor, params)])\n",
             "the pseudo-gradient's sign is flipped", 2),
    Mutation("summed, not averaged", "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n", "    dist.all_reduce(flat)\n",
             "summed but not divided", 2),
    Mutation("divided twice", "    return [d.view_as(p) for d, p in zip(flat.split(",
             "    flat /= dist.get_world_size()\n    return [d.view_as(p) for d, p in zip(flat.split(",
             "divided twice", 3),
    Mutation("never averaged", "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n", "",
             "all-reduced nothing", 2),
    Mutation("all-reduced twice", "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n",
             "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n    dist.all_reduce(flat)\n    flat /= dist.get_world_size()\n",
             "all-reduced twice", 2),
    Mutation("sent in float32 whatever the parameters' dtype",
             "    flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)])\n",
             "    flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)]).float()\n",
             "send the pseudo-gradient in their dtype", 2),
    Mutation("async all-reduce never waited", "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n",
             "    dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)\n", "never waited for", 2),
    Mutation("momentum without nesterov", "            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)\n",
             "            anchor.sub_(buf, alpha=self.lr)\n", "plain momentum without Nesterov", 2),
    Mutation("momentum buffers never used", "            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)\n",
             "            anchor.sub_(g, alpha=self.lr)\n", "the momentum buffers are not used", 2),
    Mutation("global copy not updated", "            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)\n"
             "            p.copy_(anchor)\n",
             "            p.copy_(anchor - self.lr * g.add(buf, alpha=self.momentum))\n",
             "the global copy (the anchor) is not updated", 2),
    Mutation("local parameters not reset", "            p.copy_(anchor)\n", "",
             "the local parameters were not reset", 2),
    Mutation("anchor aliases the model's parameters", "        self.anchor = [p.detach().clone() for p in self.params]\n",
             "        self.anchor = [p.detach() for p in self.params]\n", "the anchor is the model's own parameters", 2),
    Mutation("momentum buffers made in float32", "        self.buffers = [torch.zeros_like(p) for p in self.params]\n",
             "        self.buffers = [torch.zeros(p.shape) for p in self.params]\n",
             "holds torch.float32 tensors for torch.float64 parameters", 1),
    Mutation("momentum state lost on resume",
             "        for mine, saved in zip(self.anchor + self.buffers, state[\"anchor\"] + state[\"buffers\"]):\n",
             "        for mine, saved in zip(self.anchor, state[\"anchor\"]):\n", "the momentum state was lost on resume", 2),
    Mutation("anchor not restored on resume",
             "        for mine, saved in zip(self.anchor + self.buffers, state[\"anchor\"] + state[\"buffers\"]):\n",
             "        for mine, saved in zip(self.buffers, state[\"buffers\"]):\n", "the anchor was not restored", 2),
    Mutation("state_dict holds the object itself",
             "        return {\"anchor\": [a.clone() for a in self.anchor], \"buffers\": [b.clone() for b in self.buffers],\n"
             "                \"lr\": self.lr, \"momentum\": self.momentum}\n",
             "        return {\"outer\": self}\n", "weights_only=True", 2),
    Mutation("sync at every inner step", "        if step % h == 0:\n", "        if True:\n",
             "it syncs at every inner step", 2),
    Mutation("sync before the first step (counted from 0)", "    for step, (x, y) in enumerate(batches, start=1):\n",
             "    for step, (x, y) in enumerate(batches):\n", "the steps counted from 0", 2),
    Mutation("gradients never zeroed", "        inner.zero_grad()\n", "", "zero the gradients before each backward", 2),
]

# Right code written otherwise: the check must pass it.
CORRECT = [
    # REVIEW 6: load_state_dict may keep the loaded tensors (clones, or the tensors themselves as
    # torch.optim's load_state_dict keeps a buffer already on the right device): only where they live counts
    Variant("load_state_dict rebinds to clones of the saved tensors",
            "        for mine, saved in zip(self.anchor + self.buffers, state[\"anchor\"] + state[\"buffers\"]):\n"
            "            mine.copy_(saved)\n",
            "        self.anchor = [a.detach().clone() for a in state[\"anchor\"]]\n"
            "        self.buffers = [b.detach().clone() for b in state[\"buffers\"]]\n", 2),
    Variant("torch.optim.SGD(nesterov=True) on the anchor, the pseudo-gradient as its .grad",
            "        deltas = average_pseudo_gradient(self.anchor, self.params)\n"
            "        for p, anchor, buf, g in zip(self.params, self.anchor, self.buffers, deltas):\n"
            "            buf.mul_(self.momentum).add_(g)\n"
            "            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)\n"
            "            p.copy_(anchor)\n",
            "        deltas = average_pseudo_gradient(self.anchor, self.params)\n"
            "        if not hasattr(self, \"sgd\"):  # made at the first sync: after a load_state_dict\n"
            "            self.leaves = [nn.Parameter(a) for a in self.anchor]  # the anchor's own memory\n"
            "            self.sgd = torch.optim.SGD(self.leaves, lr=self.lr, momentum=self.momentum,\n"
            "                                       nesterov=self.momentum > 0)\n"
            "            for leaf, buf in zip(self.leaves, self.buffers):\n"
            "                self.sgd.state[leaf][\"momentum_buffer\"] = buf\n"
            "        for leaf, g in zip(self.leaves, deltas):\n"
            "            leaf.grad = g\n"
            "        self.sgd.step()\n"
            "        for p, leaf in zip(self.params, self.leaves):\n"
            "            p.copy_(leaf)\n", 2),
    Variant("one all-reduce per tensor, SUM then divide",
            "    flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)])\n"
            "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n"
            "    return [d.view_as(p) for d, p in zip(flat.split([p.numel() for p in params]), params)]\n",
            "    deltas = [a - p.detach() for a, p in zip(anchor, params)]\n"
            "    for d in deltas:\n"
            "        dist.all_reduce(d)\n"
            "        d /= dist.get_world_size()\n"
            "    return deltas\n", 3),
    Variant("async all-reduces, waited through their futures",
            "    flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)])\n"
            "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n"
            "    return [d.view_as(p) for d, p in zip(flat.split([p.numel() for p in params]), params)]\n",
            "    deltas = torch._foreach_sub([a for a in anchor], [p.detach() for p in params])\n"
            "    works = [dist.all_reduce(d, op=dist.ReduceOp.AVG, async_op=True) for d in deltas]\n"
            "    torch.futures.wait_all([w.get_future() for w in works])\n"
            "    return deltas\n", 2),
    Variant("the Nesterov step with torch._foreach_*",
            "        for p, anchor, buf, g in zip(self.params, self.anchor, self.buffers, deltas):\n"
            "            buf.mul_(self.momentum).add_(g)\n"
            "            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)\n"
            "            p.copy_(anchor)\n",
            "        torch._foreach_mul_(self.buffers, self.momentum)\n"
            "        torch._foreach_add_(self.buffers, deltas)\n"
            "        torch._foreach_add_(deltas, self.buffers, alpha=self.momentum)\n"
            "        torch._foreach_add_(self.anchor, deltas, alpha=-self.lr)\n"
            "        torch._foreach_copy_(self.params, self.anchor)\n", 2),
    Variant("state_dict as PyTorch's optimizers write it (a dict of per-parameter states)",
            "        return {\"anchor\": [a.clone() for a in self.anchor], \"buffers\": [b.clone() for b in self.buffers],\n"
            "                \"lr\": self.lr, \"momentum\": self.momentum}\n",
            "        return {\"state\": {i: {\"anchor\": a, \"momentum_buffer\": b}\n"
            "                          for i, (a, b) in enumerate(zip(self.anchor, self.buffers))},\n"
            "                \"lr\": self.lr, \"momentum\": self.momentum, \"anchor\": self.anchor, \"buffers\": self.buffers}\n", 2),
    Variant("the loop counts inner steps since the last sync, and keeps loss tensors' values after the step",
            "        inner.zero_grad()\n        loss = F.cross_entropy(model(x), y)\n        loss.backward()\n"
            "        inner.step()\n        losses.append(loss.item())\n        if step % h == 0:\n            outer.sync()\n",
            "        model.zero_grad(set_to_none=True)\n        loss = F.cross_entropy(model(x), y)\n        loss.backward()\n"
            "        inner.step()\n        outer.since = getattr(outer, \"since\", 0) + 1\n"
            "        if outer.since == h:\n            outer.sync()\n            outer.since = 0\n"
            "        losses.append(float(loss))\n", 3),
]
