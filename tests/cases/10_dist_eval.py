"""Chapter 10: the mistakes an exact distributed evaluation's check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("padded duplicates counted", "real = positions < n_samples", "real = positions >= 0",
             "you counted the padded duplicates", 4),
    Mutation("per-rank accuracies averaged",
             "    totals = sums.clone()\n    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n"
             "    correct, count, loss_sum = totals.tolist()\n    return correct / count, loss_sum / count\n",
             "    per_rank = torch.stack([sums[0] / sums[1], sums[2] / sums[1]])\n"
             "    dist.all_reduce(per_rank, op=dist.ReduceOp.AVG)\n    return tuple(per_rank.tolist())\n",
             "you averaged the per-rank accuracies", 4),
    Mutation("no all_reduce", "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n", "",
             "all_reduce the sums over all ranks", 2),
    Mutation("batch mean losses added up", "sums[2] += losses[real].double().sum()",
             "sums[2] += losses[real].double().mean()", "per-sample losses, reduction='none'", 2),
]
