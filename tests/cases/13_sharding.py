"""Chapter 13: the mistakes of a sharded Adam (ZeRO-1) by hand, each of which the lab's check must name."""

from pathlib import Path

from mutation import Mutation, Variant


# A correct variant that changes __init__ and step together (REVIEW 4, C13 item 4): the text from the
# moments to the step's gather, taken from the solution, with both parts changed.
_SOLUTION = (Path(__file__).resolve().parents[2] / "solutions" / "13_sharding.py").read_text()
_START = "        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)\n"
_STOP = "        gather_params(param_shard, self.params)\n"
INNER_ADAM_OLD = _SOLUTION[_SOLUTION.index(_START):_SOLUTION.index(_STOP) + len(_STOP)]
INNER_ADAM_NEW = INNER_ADAM_OLD.replace(
    _START + "        self.exp_avg_sq = torch.zeros_like(self.exp_avg)\n",
    "        self.shard = torch.nn.Parameter(flatten_padded(self.params, dist.get_world_size())"
    "[self.start:self.stop].clone())\n"
    "        self.inner = torch.optim.Adam([self.shard], lr=lr, betas=betas, eps=eps)\n").replace(
    "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))\n"
    "        param_shard = flatten_padded(self.params, world_size)[self.start:self.stop]\n"
    "        self.steps += 1\n"
    "        adam_update(param_shard, grad_shard, self.exp_avg, self.exp_avg_sq, self.steps, self.lr, self.betas, "
    "self.eps)\n" + _STOP,
    "        self.shard.grad = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))\n"
    "        self.steps += 1\n        self.inner.step()\n        gather_params(self.shard.detach(), self.params)\n")

MUTATIONS = [
    # REVIEW 6: right on gloo, wrong on a GPU: seen on the stand-in GPU (ringside.standin)
    Mutation("moments made without device=",
             "        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)\n",
             "        self.exp_avg = torch.zeros(self.stop - self.start, dtype=first.dtype)\n",
             "ShardedAdam, run as on a GPU machine", 2),
    # REVIEW 6: an argument not honoured, an input changed in place, an all-gather's bytes doubled
    Mutation("adam_update reads the lab's LR, not its lr", "    step_size = lr / (1 - beta1 ** t)\n",
             "    step_size = LR / (1 - beta1 ** t)\n", "adam_update ignores its argument(s) lr", 2),
    Mutation("the caller's gradient divided in place",
             "    dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG)\n",
             "    flat_grad /= dist.get_world_size()\n    dist.reduce_scatter_tensor(shard, flat_grad)\n",
             "changed its argument `flat_grad` in place (divided by 4)", 4),
    Mutation("all-gather as an all-reduce of a zero-filled vector",
             "    dist.all_gather_into_tensor(full, shard)\n",
             "    full.zero_()[dist.get_rank() * shard.numel():][:shard.numel()] = shard\n    dist.all_reduce(full)\n",
             "bytes sent per rank on a ring where one all-gather", 3),
    Mutation("reduce-scatter never waited for",
             "    dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG)\n",
             "    dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG, async_op=True)\n",
             "never waited for", 2),
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
             "    dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG)\n",
             "    full = flat_grad.clone()\n    dist.all_reduce(full, op=dist.ReduceOp.AVG)\n"
             "    n = full.numel() // dist.get_world_size()\n"
             "    shard = full[dist.get_rank() * n:(dist.get_rank() + 1) * n]\n",
             "average_grad_shard called all_reduce", 3),
    Mutation("gradients summed, not averaged", "dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG)",
             "dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.SUM)",
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
             "    dist.all_gather_into_tensor(full, shard)\n",
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
    Mutation("a whole shard of padding when none is needed", "    missing = -flat.numel() % world_size\n",
             "    missing = world_size - flat.numel() % world_size\n", "pad only up to the NEXT one", 2),
    Mutation("shard size numel // world_size + 1", "    size = -(-numel // world_size)\n",
             "    size = numel // world_size + 1\n", "overshoots when numel is a multiple of world_size", 2),
    Mutation("last shard cut at numel", "    return start, start + size\n",
             "    return start, min(start + size, numel)\n", "the last shard stops at 985, cut short", 3),
    Mutation("moments rebound, not updated in place",
             "    exp_avg.lerp_(grad, 1 - beta1)\n    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)\n",
             "    exp_avg = beta1 * exp_avg + (1 - beta1) * grad\n"
             "    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad\n",
             "update the moments in place", 2),
    Mutation("param rebound, not moved in place", "    param.addcdiv_(exp_avg, denominator, value=-step_size)\n",
             "    param = param - step_size * exp_avg / denominator\n", "adam_update did not move param", 2),
    Mutation("betas swapped", "    beta1, beta2 = betas\n", "    beta2, beta1 = betas\n",
             "beta1 and beta2 are swapped", 2),
    # found by trying mistakes not planted (the first two at 2, 3 and 4 ranks)
    Mutation("lerp weight swapped", "    exp_avg.lerp_(grad, 1 - beta1)\n", "    exp_avg.lerp_(grad, beta1)\n",
             "the weights are swapped", 2),
    Mutation("moments bias-corrected in place",
             "    step_size = lr / (1 - beta1 ** t)\n"
             "    denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)\n",
             "    exp_avg.div_(1 - beta1 ** t)\n    exp_avg_sq.div_(1 - beta2 ** t)\n"
             "    step_size = lr\n    denominator = exp_avg_sq.sqrt().add_(eps)\n",
             "the bias correction goes into the step only", 2),
    Mutation("eps inside the square root",
             "    denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)\n",
             "    denominator = (exp_avg_sq / (1 - beta2 ** t) + eps).sqrt()\n",
             "eps belongs outside the square root", 2),
    Mutation("eps added before the bias correction",
             "    denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)\n",
             "    denominator = exp_avg_sq.sqrt().add_(eps) / (1 - beta2 ** t) ** 0.5\n",
             "add eps after the bias correction", 2),
    Mutation("step uphill", "    param.addcdiv_(exp_avg, denominator, value=-step_size)\n",
             "    param.addcdiv_(exp_avg, denominator, value=step_size)\n", "the step goes uphill", 2),
    Mutation("gathered slices not reshaped", "        p.copy_(new.view_as(p))\n", "        p.copy_(new)\n",
             "copy_ needs the parameter's shape", 2),
    # REVIEW 3, F: moments made with torch.zeros(size) passed on a float32 CPU model
    Mutation("moments ignore the parameters' dtype and device",
             "        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)\n",
             "        self.exp_avg = torch.zeros(self.stop - self.start)\n",
             "create the moments with the parameters' dtype and device", 2),
    Mutation("one tensor for both moments", "        self.exp_avg_sq = torch.zeros_like(self.exp_avg)\n",
             "        self.exp_avg_sq = self.exp_avg\n", "exp_avg and exp_avg_sq are one tensor", 2),
    Mutation("moments sized numel // world_size",
             "        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)\n",
             "        self.exp_avg = torch.zeros(self.numel // dist.get_world_size(), device=first.device, "
             "dtype=first.dtype)\n", "exp_avg has 246 elements, but this rank's shard has 247", 4),
    Mutation("step never calls gather_params", "        gather_params(param_shard, self.params)\n", "",
             "left the weights unchanged and made no all-gather", 2),
    Mutation("gather before the update",
             "        adam_update(param_shard, grad_shard, self.exp_avg, self.exp_avg_sq, self.steps, self.lr, "
             "self.betas, self.eps)\n        gather_params(param_shard, self.params)\n",
             "        gather_params(param_shard, self.params)\n        adam_update(param_shard, grad_shard, "
             "self.exp_avg, self.exp_avg_sq, self.steps, self.lr, self.betas, self.eps)\n",
             "gather_params must send the shard AFTER adam_update", 2),
    Mutation("step uses this rank's own gradient",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))\n",
             "        grad_shard = flatten_padded([p.grad for p in self.params], world_size)[self.start:self.stop]\n",
             "this rank's own gradient, not the average", 3),
    Mutation("step divides the averaged shard again",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))\n",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size)) "
             "/ world_size\n", "averaged twice", 4),
    Mutation("step updates all the parameters, not the shard",
             "        param_shard = flatten_padded(self.params, world_size)[self.start:self.stop]\n",
             "        param_shard = flatten_padded(self.params, world_size)\n",
             "adam_update all the flattened parameters", 2),
    Mutation("step slices the averaged shard again",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))\n",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))"
             "[self.start:self.stop]\n", "do not slice it again", 3),
    # REVIEW 4, A and C13 item 4: the optimizer's state measured by the memory it keeps alive
    Mutation("full-size spare moments beside the shard's",
             "        self.exp_avg_sq = torch.zeros_like(self.exp_avg)\n",
             "        self.exp_avg_sq = torch.zeros_like(self.exp_avg)\n"
             "        self.spare = torch.zeros(self.numel * 2, device=first.device, dtype=first.dtype)\n",
             "not for all parameters", 2),
    Mutation("moments are views of a whole-model buffer",
             "        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)\n"
             "        self.exp_avg_sq = torch.zeros_like(self.exp_avg)\n",
             "        whole = torch.zeros(2, self.stop * dist.get_world_size(), device=first.device, dtype=first.dtype)\n"
             "        self.exp_avg, self.exp_avg_sq = whole[0, self.start:self.stop], whole[1, self.start:self.stop]\n",
             "a view of a larger tensor", 3),
    Mutation("step multiplies the averaged shard by world_size",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))\n",
             "        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size)) "
             "* world_size\n", "it is the sum", 2),
]


# Right code written otherwise: the check must pass it (found by trying it as a learner might).
CORRECT = [
    Variant("Adam as the paper writes it (bias-corrected copies, another rounding)",
            "    exp_avg.lerp_(grad, 1 - beta1)\n    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)\n"
            "    step_size = lr / (1 - beta1 ** t)\n"
            "    denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)\n"
            "    param.addcdiv_(exp_avg, denominator, value=-step_size)\n",
            "    exp_avg.mul_(beta1).add_(grad * (1 - beta1))\n    exp_avg_sq.mul_(beta2).add_(grad * grad * (1 - beta2))\n"
            "    m_hat = exp_avg / (1 - beta1 ** t)\n    v_hat = exp_avg_sq / (1 - beta2 ** t)\n"
            "    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))\n", 3),
    Variant("an inner torch.optim.Adam steps a copy of the shard", INNER_ADAM_OLD, INNER_ADAM_NEW, 2),
    Variant("reduce-scatter of a list of chunks, summed then divided",
            "    shard = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size())\n"
            "    dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG)\n    return shard\n",
            "    chunks = list(flat_grad.chunk(dist.get_world_size()))\n"
            "    shard = torch.empty_like(chunks[0])\n    dist.reduce_scatter(shard, chunks)\n"
            "    return shard / dist.get_world_size()\n", 3),
    Variant("all-gather into a list, waited through async_op and wait()",
            "    full = shard.new_empty(shard.numel() * dist.get_world_size())\n"
            "    dist.all_gather_into_tensor(full, shard)\n",
            "    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]\n"
            "    dist.all_gather(pieces, shard, async_op=True).wait()\n    full = torch.cat(pieces)\n", 2),
    Variant("padding with F.pad",
            "    flat = torch.cat([t.detach().reshape(-1) for t in tensors])\n"
            "    missing = -flat.numel() % world_size\n    return torch.cat([flat, flat.new_zeros(missing)])\n",
            "    flat = torch.cat([t.detach().reshape(-1) for t in tensors])\n"
            "    return torch.nn.functional.pad(flat, (0, -flat.numel() % world_size))\n", 4),
]
