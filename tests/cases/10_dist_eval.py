"""Chapter 10: the mistakes an exact distributed evaluation's check must name."""

from mutation import Mutation, Variant

MUTATIONS = [
    Mutation("padded duplicates counted", "            real = positions < n_samples\n",
             "            real = positions >= 0\n",
             "you counted the padded duplicates", 4),
    Mutation("positions without the running offset",
             "positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)",
             "positions = rank + world_size * torch.arange(len(y), device=device)",
             "the position of a sample continues across batches", 4),
    Mutation("positions without the rank",
             "positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)",
             "positions = world_size * torch.arange(seen, seen + len(y), device=device)",
             "the positions leave out the rank", 4),
    Mutation("positions of contiguous shards",
             "positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)",
             "positions = rank * len(loader.sampler) + torch.arange(seen, seen + len(y), device=device)",
             "the positions assume contiguous shards", 4),
    Mutation("padding counted in the count only", "sums[1] += real.sum()", "sums[1] += len(y)",
             "the count includes the padding copies", 3),
    Mutation("no model.eval()", "    model.eval()\n", "", "call model.eval()", 2),
    Mutation("per-rank accuracies averaged",
             "    totals = sums.clone()\n    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n"
             "    correct, count, loss_sum = totals.tolist()\n    return correct / count, loss_sum / count\n",
             "    per_rank = torch.stack([sums[0] / sums[1], sums[2] / sums[1]])\n"
             "    dist.all_reduce(per_rank, op=dist.ReduceOp.AVG)\n    return tuple(per_rank.tolist())\n",
             "you averaged the per-rank accuracies", 4),
    Mutation("no all_reduce", "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n", "",
             "all_reduce the sums over all ranks", 2),
    Mutation("MAX instead of SUM", "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n",
             "    dist.all_reduce(totals, op=dist.ReduceOp.MAX)\n", "not MAX", 3),
    Mutation("all_reduce on the caller's tensor", "    totals = sums.clone()\n", "    totals = sums\n",
             "exact_metrics changed its argument `sums` in place", 2),
    Mutation("float32 sums", "sums = torch.zeros(3, dtype=torch.float64, device=device)",
             "sums = torch.zeros(3, device=device)", "return one float64 tensor", 2),
    Mutation("batch mean losses added up", "sums[2] += losses[real].double().sum()",
             "sums[2] += losses[real].double().mean()", "adding up batch means", 2),
    # Found by a learner trying mistakes of their own:
    Mutation("mask off by one", "            real = positions < n_samples\n",
             "            real = positions <= n_samples\n", "the mask must be positions < n_samples", 4),
    Mutation("mask left off correct", "sums[0] += (logits.argmax(dim=1) == y)[real].sum()",
             "sums[0] += (logits.argmax(dim=1) == y).sum()", "correct includes the padding copies", 4),
    Mutation("training mode restored after a batch-mean loss",  # model.train() after is fine: not blamed
             "            sums[2] += losses[real].double().sum()\n    return sums\n",
             "            sums[2] += losses[real].double().mean()\n    model.train()\n    return sums\n",
             "adding up batch means", 4),
    Mutation("float16 sums converted at the end",  # float32 ones stay within the tolerance: CORRECT
             "            sums[2] += losses[real].double().sum()\n    return sums\n",
             "            sums = sums.half()  # a float16 accumulator\n"
             "            sums[2] += losses[real].half().sum()\n    return sums.double()\n",
             "added up in float16", 4),
    Mutation("count of batches", "sums[1] += real.sum()", "sums[1] += 1", "the number of batches", 2),
    Mutation("all_reduce inside local_sums", "    return sums\n", "    dist.all_reduce(sums)\n    return sums\n",
             "returned the totals over all ranks", 2),
    Mutation("positions computed after the batch was counted (every sample shifted one batch on)",
             "            positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)\n"
             "            real = positions < n_samples\n            seen += len(y)\n",
             "            seen += len(y)\n"
             "            positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)\n"
             "            real = positions < n_samples\n",
             "no sample was counted as real on any rank", 3),
]

CORRECT = [  # a float32 loss sum of 1,001 losses is off by about 4e-8 relative, inside the check's 1e-6
    Variant("float32 sums converted at the end",
            "            sums[2] += losses[real].double().sum()\n    return sums\n",
            "            sums = sums.float()  # a float32 accumulator, as torch.zeros(3) makes\n"
            "            sums[2] += losses[real].sum()\n    return sums.double()\n", 4),
]

NPROCS = (2, 3, 4, 5)
REFUSES = (1,)  # at one rank the classic mistakes give the right answer
NODES = True  # rank-0 work
