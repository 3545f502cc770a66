"""Chapter 13: the mistakes of a sharded Adam (ZeRO-1) by hand, each of which the lab's check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("no padding", "    missing = -flat.numel() % world_size\n", "    missing = 0\n",
             "pad with zeros so that every shard has the same size", 3),
    Mutation("shards skip the tail (size rounded down)", "    size = -(-numel // world_size)\n",
             "    size = numel // world_size\n", "the shards skip", 4),
    Mutation("shards repeat an element (stop included)", "    return start, start + size\n",
             "    return start, start + size + 1\n", "the shards repeat elements", 3),
    Mutation("wrong shard for the rank", "    start = rank * size\n", "    start = (world_size - 1 - rank) * size\n",
             "wrong shard for this rank", 2),
    Mutation("all_reduce where reduce_scatter belongs",
             "    shard = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size())\n"
             "    dist.reduce_scatter_single(shard, flat_grad, op=dist.ReduceOp.AVG)\n",
             "    full = flat_grad.clone()\n    dist.all_reduce(full, op=dist.ReduceOp.AVG)\n"
             "    n = full.numel() // dist.get_world_size()\n"
             "    shard = full[dist.get_rank() * n:(dist.get_rank() + 1) * n]\n",
             "average_grad_shard called all_reduce", 3),
    Mutation("gradients summed, not averaged", "dist.reduce_scatter_single(shard, flat_grad, op=dist.ReduceOp.AVG)",
             "dist.reduce_scatter_single(shard, flat_grad, op=dist.ReduceOp.SUM)",
             "it is the sum - average it", 3),
    Mutation("gradients averaged twice", "    return shard\n", "    return shard / dist.get_world_size()\n",
             "averaged twice", 2),
    Mutation("no bias correction",
             "    step_size = lr / (1 - beta1 ** t)\n"
             "    denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)\n",
             "    step_size = lr\n    denominator = exp_avg_sq.sqrt().add_(eps)\n",
             "the bias correction is missing", 2),
    Mutation("step counted after the update (t = 0 first)",
             "        self.steps += 1\n        adam_update(param_shard, grad_shard, self.exp_avg, self.exp_avg_sq, "
             "self.steps, self.lr, self.betas, self.eps)\n",
             "        adam_update(param_shard, grad_shard, self.exp_avg, self.exp_avg_sq, self.steps, self.lr, "
             "self.betas, self.eps)\n        self.steps += 1\n",
             "count the step before the update", 2),
    Mutation("bias correction always for step 1",
             "self.exp_avg_sq, self.steps, self.lr,", "self.exp_avg_sq, 1, self.lr,",
             "does the bias correction use the right step count", 3),
    Mutation("no all_gather (each rank keeps only its own update)",
             "    dist.all_gather_single(full, shard)\n",
             "    rank, n = dist.get_rank(), shard.numel()\n"
             "    full = flatten_padded(params, dist.get_world_size())\n    full[rank * n:(rank + 1) * n] = shard\n",
             "gather_params made no all-gather", 3),
    Mutation("padding not stripped", "full[:total].split(", "full.split(", "strip the padding", 3),
    Mutation("state kept for all parameters",
             "        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)\n",
             "        self.exp_avg = torch.zeros(self.numel, device=first.device, dtype=first.dtype)\n",
             "not for all parameters", 3),
    Mutation("every rank updates the first shard", "flatten_padded(self.params, world_size)[self.start:self.stop]",
             "flatten_padded(self.params, world_size)[:self.stop - self.start]",
             "the weights differ from DDP + torch.optim.Adam", 2),
]

NPROCS = (2, 3, 4)
