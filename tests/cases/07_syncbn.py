"""Chapter 07: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("biased running variance", "momentum * var * count / (count - 1))", "momentum * var)",
             "it matches the biased variance", 2),
    Mutation("no all_reduce in backward", "        dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)\n", "",
             "is there an all_reduce missing in backward?", 4),
    Mutation("mean of means",
             "torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (x * x).sum(dims)])",
             "torch.stack([torch.ones_like(local_sum), x.mean(dims), (x * x).mean(dims)])",
             "are you averaging means instead of weighting by count?", 4),
    Mutation("no all_reduce in forward", "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n", "",
             "are the statistics all_reduced?", 2),
    Mutation("all-reduced weight gradient", "grad_weight, grad_bias = local_sums[1].clone(), local_sums[0].clone()\n",
             "grad_weight, grad_bias = local_sums[1], local_sums[0]\n", "4x too large after summing over ranks", 4),
]
