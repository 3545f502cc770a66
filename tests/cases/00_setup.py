"""Chapter 00: the mistakes its check must name."""

from mutation import Mutation

SUM = "    dist.all_reduce(mine, op=dist.ReduceOp.SUM)\n"

MUTATIONS = [
    Mutation("no all_reduce", SUM, "", "did you call dist.all_reduce", 4),
    # REVIEW D: 0+1 = max(0, 1), so the rank numbers alone cannot tell MAX from SUM at 2 ranks
    Mutation("MAX instead of SUM (2 ranks)", "(mine, op=dist.ReduceOp.SUM)", "(mine, op=dist.ReduceOp.MAX)",
             "did you reduce with MAX instead of SUM?", 2),
    Mutation("MAX instead of SUM (3 ranks)", "(mine, op=dist.ReduceOp.SUM)", "(mine, op=dist.ReduceOp.MAX)",
             "did you reduce with MAX instead of SUM?", 3),
    Mutation("MIN instead of SUM", "(mine, op=dist.ReduceOp.SUM)", "(mine, op=dist.ReduceOp.MIN)",
             "did you reduce with MIN instead of SUM?", 2),
    Mutation("PRODUCT instead of SUM", "(mine, op=dist.ReduceOp.SUM)", "(mine, op=dist.ReduceOp.PRODUCT)",
             "did you reduce with PRODUCT instead of SUM?", 3),
    Mutation("all_reduce on a copy", SUM, "    dist.all_reduce(mine.clone(), op=dist.ReduceOp.SUM)\n",
             "a copy or a new tensor keeps the old value", 2),
    Mutation("reduce to rank 0 only", SUM, "    dist.reduce(mine, dst=0, op=dist.ReduceOp.SUM)\n",
             "dist.reduce leaves the sum on one rank", 3),
    Mutation("the mean instead of the sum", "    return int(mine.item())\n",
             "    return int(mine.item()) // dist.get_world_size()\n", "did you divide by world_size", 3),
    Mutation("adds the rank numbers, not the values",
             "    mine = torch.tensor([value], device=device)\n",
             "    mine = torch.tensor([dist.get_rank()], device=device)\n",
             "you added the rank numbers, not the values passed in", 3),
    Mutation("returns the tensor", "    return int(mine.item())\n", "    return mine\n",
             "return a Python int", 2),
    Mutation("hard-coded rank", "rank, world_size = dist.get_rank(), dist.get_world_size()\n    local_rank",
             "rank, world_size = 0, dist.get_world_size()\n    local_rank",
             "read dist.get_rank() and dist.get_world_size(), not constants"),
    Mutation("hard-coded world size", "rank, world_size = dist.get_rank(), dist.get_world_size()\n    local_rank",
             "rank, world_size = dist.get_rank(), 4\n    local_rank",
             "read dist.get_rank() and dist.get_world_size(), not constants", 3),
    Mutation("hard-coded backend", "backend {dist.get_backend()}\"\n", "backend nccl\"\n",
             "ask dist.get_backend()", 2),
    Mutation("the collective's result returned (None: all_reduce works in place)",
             "    dist.all_reduce(mine, op=dist.ReduceOp.SUM)\n    return int(mine.item())\n",
             "    return dist.all_reduce(mine, op=dist.ReduceOp.SUM)\n",
             "returned None"),
]

NODES = True  # LOCAL_RANK and the rank's device
