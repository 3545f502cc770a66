"""Chapter 16: the mistakes of fully sharded data parallel (ZeRO-3) by hand, each of which the lab's
check must name."""

from mutation import Mutation, Variant

MUTATIONS = [
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
]
