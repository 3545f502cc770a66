"""Chapter 00: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("no all_reduce", "    dist.all_reduce(mine, op=dist.ReduceOp.SUM)\n", "",
             "did you call dist.all_reduce?", 4),
    Mutation("MAX instead of SUM", "op=dist.ReduceOp.SUM)", "op=dist.ReduceOp.MAX)",
             "did you reduce with MAX instead of SUM?", 4),
    Mutation("hard-coded rank", "rank, world_size = dist.get_rank(), dist.get_world_size()\n    local_rank",
             "rank, world_size = 0, dist.get_world_size()\n    local_rank",
             "read dist.get_rank() and dist.get_world_size(), not constants"),
]
