"""Chapter 16: the mistakes of fully sharded data parallel (ZeRO-3) by hand, each of which the lab's
check must name."""

from mutation import Mutation, Variant

MUTATIONS = [
    # REVIEW 6: right on gloo, wrong on a GPU: seen on the stand-in GPU (ringside.standin)
    Mutation("all-gather output made on the CPU", "    full = send.new_empty(send.numel() * dist.get_world_size())\n",
             "    full = torch.empty(send.numel() * dist.get_world_size(), dtype=dtype)\n",
             "all_gather_flat and average_shard, run as on a GPU machine", 2),
    Mutation("shard of the wrong rank", "    start = rank * size\n", "    start = (world_size - 1 - rank) * size\n",
             "a shard of the wrong rank", 2),
    Mutation("no padding (shard size rounded down)",
             "    size = -(-flat.numel() // world_size)\n"
             "    padded = torch.cat([flat.detach(), flat.new_zeros(size * world_size - flat.numel())])\n",
             "    size = flat.numel() // world_size\n    padded = flat.detach()\n", "the shards skip elements", 2),
    Mutation("no padding (the last shard shorter)",
             "    padded = torch.cat([flat.detach(), flat.new_zeros(size * world_size - flat.numel())])\n",
             "    padded = flat.detach()\n", "the shards have unequal sizes", 2),
    Mutation("padding with real values, fed to the optimizer",
             "flat.new_zeros(size * world_size - flat.numel())])\n",
             "flat[:size * world_size - flat.numel()]])\n", "the padding is fed to the optimizer", 2),
    Mutation("shard returned as a view", "    return padded[start:start + size].clone()\n",
             "    return flat[start:start + size] if start + size <= flat.numel() else padded[start:start + size]\n",
             "returned a view of its input", 2),
    Mutation("gathered in fp32, cast afterwards",
             "    send = shard.detach().to(dtype)\n    full = send.new_empty(send.numel() * dist.get_world_size())\n"
             "    dist.all_gather_into_tensor(full, send)\n    return full\n",
             "    send = shard.detach()\n    full = send.new_empty(send.numel() * dist.get_world_size())\n"
             "    dist.all_gather_into_tensor(full, send)\n    return full.to(dtype)\n",
             "cast the shard to the compute dtype BEFORE the all-gather", 2),
    Mutation("reduce done in bf16", "    grad = full_grad.to(torch.float32)\n    shard = grad.new_empty(",
             "    grad = full_grad\n    shard = grad.new_empty(", "the reduce done in bf16", 2),
    Mutation("gradients summed, not divided", "dist.reduce_scatter_tensor(shard, grad, op=dist.ReduceOp.AVG)",
             "dist.reduce_scatter_tensor(shard, grad, op=dist.ReduceOp.SUM)", "summed but not divided", 2),
    Mutation("gradients divided twice", "    return shard\n    # END SOLUTION\n\n\nclass GatherUnit",
             "    return shard / dist.get_world_size()\n    # END SOLUTION\n\n\nclass GatherUnit",
             "divided twice", 2),
    Mutation("master weights left in the compute dtype",
             "        self.shard = nn.Parameter(shard_of(flat.float(), dist.get_rank(), dist.get_world_size()))\n",
             "        self.shard = nn.Parameter(shard_of(flat.to(dtype), dist.get_rank(), dist.get_world_size()))\n",
             "the master weights left in the compute dtype", 2),
    Mutation("a unit never freed", "        self.place(None)\n        self.gathered = None\n",
             "        self.gathered = None\n", "a unit never freed", 2),
    Mutation("autograd keeps the gathered unit (no saved-tensor hooks)",
             "            return tensor.storage_offset(), tensor.size(), tensor.stride()\n        return tensor\n",
             "            return tensor\n        return tensor\n", "autograd saved them for backward", 2),
    Mutation("the gather not redone for backward",
             "            self.backward_copy = all_gather_flat(self.shard, self.dtype)\n",
             "            self.backward_copy = torch.zeros(self.shard.numel() * dist.get_world_size(), "
             "dtype=self.dtype)\n", "the gather not redone for backward", 2),
    Mutation("the copy gathered for backward never freed", "        ctx.unit.backward_copy = None\n", "",
             "units gathered for backward are still alive", 2),
    Mutation("replicated gradients not averaged", "                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n",
             "                pass\n", "its gradient was not averaged", 2),
    Mutation("replicated gradients summed", "                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n",
             "                dist.all_reduce(p.grad)\n", "summed but not divided", 2),
    Mutation("full parameters from this rank's shard only",
             "all_gather_flat(unit.shard, torch.float32)[:sum(unit.numels)].split(unit.numels)",
             "unit.shard.detach().repeat(dist.get_world_size())[:sum(unit.numels)].split(unit.numels)",
             "the weights differ from one process on the global batch", 2),
    Mutation("views include a padding offset", "        pieces = full[:sum(self.numels)].split(self.numels)",
             "        pieces = full[-sum(self.numels):].split(self.numels)",
             "are the layer's views the first numel elements of the gathered unit", 2),
    # REVIEW 4, A and C16 items 10-12: the backward re-gather at an offset, the tied weight, bf16 checkpoints
    Mutation("unpack drops the storage offset", "        return self.backward_copy.as_strided(size, stride, offset)\n",
             "        return self.backward_copy.as_strided(size, stride)\n", "unpack dropped the storage offset", 2),
    Mutation("pack compares data_ptr(), not the storage",
             "tensor.untyped_storage().data_ptr() == self.gathered.untyped_storage().data_ptr()",
             "tensor.data_ptr() == self.gathered.data_ptr()", "tensor.data_ptr() is where a view's first element lies",
             2),
    Mutation("unpack gathers again for every saved tensor",
             "        if self.backward_copy is None:\n            self.backward_copy = all_gather_flat(self.shard, self.dtype)\n"
             "        return self.backward_copy.as_strided(size, stride, offset)\n",
             "        return all_gather_flat(self.shard, self.dtype).as_strided(size, stride, offset)\n",
             "once per backward", 2),
    Mutation("unpack gathers in fp32, then casts",
             "            self.backward_copy = all_gather_flat(self.shard, self.dtype)\n",
             "            self.backward_copy = all_gather_flat(self.shard, torch.float32).to(self.dtype)\n",
             "in the backward, 2x the bytes", 2),
    Mutation("after_forward keeps self.gathered", "        self.place(None)\n        self.gathered = None\n",
             "        self.place(None)\n", "the unit's attribute 'gathered' still refers to the gathered unit", 2),
    Mutation("full parameters gathered in the compute dtype",
             "all_gather_flat(unit.shard, torch.float32)[:sum(unit.numels)].split(unit.numels)",
             "all_gather_flat(unit.shard, unit.dtype)[:sum(unit.numels)].split(unit.numels)",
             "a checkpoint of the compute dtype", 2),
    Mutation("the tied weight all-reduced twice", "            if p.grad is not None and id(p) not in done:\n",
             "            if p.grad is not None:\n", "held by two layers, was all-reduced twice", 2),
    Mutation("the frozen parameter's None handed to all_reduce",
             "            if p.grad is not None and id(p) not in done:\n", "            if id(p) not in done:\n",
             "out.fc2.bias has no gradient (grad is None: frozen)", 2),
    Mutation("every unit keeps rank 0's shard",
             "        self.shard = nn.Parameter(shard_of(flat.float(), dist.get_rank(), dist.get_world_size()))\n",
             "        self.shard = nn.Parameter(shard_of(flat.float(), 0, dist.get_world_size()))\n",
             "a shard of the wrong rank", 2),
    Mutation("finish_gradient_sync does nothing", "        for _, _, p in self.replicated:\n", "        for _, _, p in []:\n",
             "its gradient was not averaged", 2),
    # REVIEW 5, x1: the shard a view of the padded temporary: values right, memory not sharded
    Mutation("shard_of returns a view of the padded vector (no clone)",
             "    return padded[start:start + size].clone()\n", "    return padded[start:start + size]\n",
             "the shard keeps the whole padded unit alive", 2),
]


# Right code written otherwise: the check must pass it.
CORRECT = [
    Variant("all-gather into a list of tensors, then cat",
            "    full = send.new_empty(send.numel() * dist.get_world_size())\n"
            "    dist.all_gather_into_tensor(full, send)\n    return full\n",
            "    pieces = [torch.empty_like(send) for _ in range(dist.get_world_size())]\n"
            "    dist.all_gather(pieces, send)\n    return torch.cat(pieces)\n", 3),
    Variant("reduce with SUM, then divide in fp32",
            "    dist.reduce_scatter_tensor(shard, grad, op=dist.ReduceOp.AVG)\n    return shard\n",
            "    dist.reduce_scatter_tensor(shard, grad)\n    return shard / dist.get_world_size()\n", 3),
    Variant("pack keyed on the view's ._base",
            "        if self.gathered is not None and tensor.untyped_storage().data_ptr() == "
            "self.gathered.untyped_storage().data_ptr():\n",
            "        if self.gathered is not None and (tensor._base if tensor._base is not None else tensor) is "
            "self.gathered:\n", 2),
    Variant("the replicated gradients averaged in one flat buffer",
            "        done = set()\n        for _, _, p in self.replicated:\n"
            "            if p.grad is not None and id(p) not in done:\n"
            "                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)\n                done.add(id(p))\n",
            "        grads = list({id(p): p.grad for _, _, p in self.replicated if p.grad is not None}.values())\n"
            "        if grads:\n            flat = torch.cat([g.reshape(-1) for g in grads])\n"
            "            dist.all_reduce(flat)\n            flat /= dist.get_world_size()\n"
            "            for g, new in zip(grads, flat.split([g.numel() for g in grads])):\n"
            "                g.copy_(new.view_as(g))\n", 2),
    Variant("async all-gather, waited through its future, by a name imported from torch.distributed",
            "    dist.all_gather_into_tensor(full, send)\n    return full\n",
            "    from torch.distributed import all_gather_into_tensor\n"
            "    all_gather_into_tensor(full, send, async_op=True).get_future().wait()\n    return full\n", 2),
    Variant("unpack through torch.as_strided of the cached copy",
            "        if self.backward_copy is None:\n            self.backward_copy = all_gather_flat(self.shard, self.dtype)\n"
            "        return self.backward_copy.as_strided(size, stride, offset)\n",
            "        if self.backward_copy is None:\n            self.backward_copy = all_gather_flat(self.shard, self.dtype)\n"
            "        whole = self.backward_copy\n        return torch.as_strided(whole, size, stride, offset)\n", 2),
]
