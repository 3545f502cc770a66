"""Chapter 18: the mistakes of the gradient noise scale, its average, the scaled learning rate and the decision,
each of which the lab's check must name."""

from pathlib import Path

from mutation import Mutation, Variant

SOLUTION = (Path(__file__).parents[2] / "solutions" / "18_batch_scaling.py").read_text()
# NoiseScale's update() and value() from the averages' update to value()'s return: one variant changes both.
NOISE_SCALE_BODY = SOLUTION[SOLUTION.index("        self.g2 = self.beta * self.g2"):
                            SOLUTION.index("else math.inf\n") + len("else math.inf\n")]

NPROCS = (1, 2, 3, 4, 5)  # at 1 rank the micro-batches stand in for ranks: nothing to refuse

SQUARES = "    small = torch.stack([g.square().sum() for g in micro_grads]).sum().reshape(1)\n"
AVERAGE = ("    dist.all_reduce(mean, group=group)\n    dist.all_reduce(small, group=group)\n    mean /= count\n"
           "    small_sq, big_sq = small[0] / count, mean.square().sum()\n")

MUTATIONS = [
    Mutation("gradient divided by N twice (AVG, then divided by the count)", "    dist.all_reduce(mean, group=group)\n",
             "    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=group)\n", "divided by the number of micro-batches twice", 2),
    Mutation("norms of the summed gradient", "    mean /= count\n", "", "the norms of the summed gradient", 2),
    Mutation("the biased |G|^2", "    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)\n",
             "    g2 = big_sq\n", "biased upwards", 2),
    Mutation("|G_small|^2 from this rank's micro-batches only", AVERAGE,
             "    dist.all_reduce(mean, group=group)\n    mean /= count\n"
             "    small_sq, big_sq = small[0] / len(micro_grads), mean.square().sum()\n", "this rank's micro-batches only", 3),
    Mutation("norms not squared", SQUARES + AVERAGE,
             (SQUARES + AVERAGE).replace("g.square().sum()", "g.norm()").replace("mean.square().sum()", "mean.norm()"),
             "the norms were not squared", 2),
    Mutation("B_big without the micro-batches", "    b_small, b_big = micro_batch, micro_batch * count\n",
             "    b_small, b_big = micro_batch, micro_batch * dist.get_world_size(group)\n", "B_big left out the micro-batches", 2),
    Mutation("the job's size for the group's", "    count = len(micro_grads) * dist.get_world_size(group)\n",
             "    count = len(micro_grads) * dist.get_world_size()\n", "the whole job's size was used for the group's", 3),
    Mutation("computed in float32 whatever the gradients' dtype", "    mean = torch.stack(micro_grads).sum(0)\n",
             "    mean = torch.stack(micro_grads).sum(0).float()\n", "in the gradients' dtype", 2),
    Mutation("one micro-batch not refused", "    if count < 2:\n", "    if count < 1:\n", "raise ValueError", 2),
    Mutation("the gradient all-reduced a second time for its norm", "    dist.all_reduce(small, group=group)\n",
             "    dist.all_reduce(small, group=group)\n    dist.all_reduce(torch.stack(micro_grads).sum(0), group=group)\n",
             "the gradient's bytes once is enough", 2),
    Mutation("the sum built in the caller's first gradient", "    mean = torch.stack(micro_grads).sum(0)\n",
             "    mean = micro_grads[0]\n    for g in micro_grads[1:]:\n        mean += g\n",
             "changed its argument `micro_grads` in place", 2),
    Mutation("per-step ratios averaged",
             "        self.trace = self.beta * self.trace + (1 - self.beta) * float(trace)\n",
             "        self.ratio = self.beta * getattr(self, \"ratio\", 0.0) + (1 - self.beta) * float(trace) / float(g2)\n"
             "        self.trace, self.g2 = self.ratio, 1.0  # value() now returns the average of the ratios\n",
             "the per-step ratios were averaged", 1),
    Mutation("beta and 1 - beta swapped",
             "        self.g2 = self.beta * self.g2 + (1 - self.beta) * float(g2)\n"
             "        self.trace = self.beta * self.trace + (1 - self.beta) * float(trace)\n",
             "        self.g2 = (1 - self.beta) * self.g2 + self.beta * float(g2)\n"
             "        self.trace = (1 - self.beta) * self.trace + self.beta * float(trace)\n", "beta and 1 - beta are swapped", 1),
    Mutation("no inf for a |G|^2 average that is not positive",
             "        return self.trace / self.g2 if self.g2 > 0 else math.inf\n", "        return self.trace / self.g2\n",
             "return inf while it is not positive", 1),
    Mutation("warmup off by one (at the peak a step early)", "    done = min(1.0, step / warmup) if warmup > 0 else 1.0\n",
             "    done = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0\n", "reaches its peak a step early", 1),
    Mutation("the scaling applied twice", "{\"none\": 1.0, \"linear\": ratio, \"sqrt\": math.sqrt(ratio)}",
             "{\"none\": 1.0, \"linear\": ratio * ratio, \"sqrt\": ratio}", "the scaling was applied twice", 1),
    Mutation("warmup from zero", "    return base_lr + (peak - base_lr) * done\n", "    return peak * done\n",
             "the warmup starts from 0", 1),
    Mutation("no rank at all below one rank's batch", "    return max(1, min(available, math.floor(",
             "    return (min(available, math.floor(", "at least one rank trains", 1),
]

# Right code written otherwise: the check must pass it.
CORRECT = [
    Variant("one all-reduce of a packed buffer (the summed gradient and the summed squared norms)",
            "    mean = torch.stack(micro_grads).sum(0)\n"
            "    small = torch.stack([g.square().sum() for g in micro_grads]).sum().reshape(1)\n"
            "    dist.all_reduce(mean, group=group)\n    dist.all_reduce(small, group=group)\n",
            "    packed = torch.cat([torch.stack(micro_grads).sum(0),\n"
            "                        torch.stack([g.dot(g) for g in micro_grads]).sum().reshape(1)])\n"
            "    dist.all_reduce(packed, group=group)\n    mean, small = packed[:-1].clone(), packed[-1:]\n", 3),
    Variant("ReduceOp.AVG of each rank's own means, asynchronous, waited through futures",
            AVERAGE,
            "    mean /= len(micro_grads)\n    small /= len(micro_grads)\n"
            "    works = [dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group, async_op=True) for t in (mean, small)]\n"
            "    torch.futures.wait_all([w.get_future() for w in works])\n"
            "    small_sq, big_sq = small[0], torch.linalg.vector_norm(mean) ** 2\n", 2),
    Variant("both averages bias-corrected (the corrections cancel in the ratio)",
            NOISE_SCALE_BODY,
            "        self.t = getattr(self, \"t\", 0) + 1\n" + NOISE_SCALE_BODY.replace(
                "        return self.trace / self.g2 if self.g2 > 0 else math.inf\n",
                "        t = getattr(self, \"t\", 0)\n"
                "        g2, trace = (self.g2 / (1 - self.beta ** t), self.trace / (1 - self.beta ** t)) if t else (0.0, 0.0)\n"
                "        return trace / g2 if g2 > 0 else math.inf\n"), 1),
    Variant("the schedule as an interpolation with a power",
            "    ratio = batch / base_batch\n"
            "    peak = base_lr * {\"none\": 1.0, \"linear\": ratio, \"sqrt\": math.sqrt(ratio)}[rule]\n"
            "    done = min(1.0, step / warmup) if warmup > 0 else 1.0\n"
            "    return base_lr + (peak - base_lr) * done\n",
            "    peak = base_lr * (batch / base_batch) ** {\"none\": 0, \"linear\": 1, \"sqrt\": 0.5}[rule]\n"
            "    if step >= warmup:\n        return peak\n"
            "    return (1 - step / warmup) * base_lr + step / warmup * peak\n", 1),
    Variant("ranks_to_use by counting down from those available",
            "    if math.isinf(b_noise):\n        return available\n"
            "    return max(1, min(available, math.floor(b_noise / per_rank_batch)))\n",
            "    n = available\n    while n > 1 and n * per_rank_batch > b_noise:\n        n -= 1\n    return n\n", 1),
]
