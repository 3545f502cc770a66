"""Chapter 00: the mistakes its check must name."""

from mutation import Mutation, Variant

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
    # REVIEW 5, A (held back since round 2): an async all-reduce never waited was named "each rank's own
    # value"; on gloo its value is a race, its completion is not
    Mutation("async all_reduce never waited", SUM, "    dist.all_reduce(mine, op=dist.ReduceOp.SUM, async_op=True)\n",
             "never waited for (all_reduce)", 2),
]

NODES = True  # LOCAL_RANK and the rank's device

MUTATIONS += [
    # REVIEW B: a global rank where the local one belongs passes on one node (RANK == LOCAL_RANK)
    Mutation("local rank read from RANK", 'local_rank = int(os.environ["LOCAL_RANK"])',
             'local_rank = int(os.environ["RANK"])', "read os.environ['LOCAL_RANK'], not the global rank", 2),
    Mutation("local rank taken from dist.get_rank()", 'local_rank = int(os.environ["LOCAL_RANK"])',
             "local_rank = dist.get_rank()", "read os.environ['LOCAL_RANK'], not the global rank", 3),
    Mutation("a float returned", "    return int(mine.item())\n", "    return float(mine.item())\n",
             "return a Python int", 2),
]

SUM_BODY = ("    mine = torch.tensor([value], device=device)\n    dist.all_reduce(mine, op=dist.ReduceOp.SUM)\n"
            "    return int(mine.item())\n")

CORRECT = [
    Variant("every value all-gathered into one tensor, then summed", SUM_BODY,
            "    everyone = torch.empty(dist.get_world_size(), dtype=torch.long, device=device)\n"
            "    dist.all_gather_into_tensor(everyone, torch.tensor([value], device=device))\n"
            "    return int(everyone.sum().item())\n", 3),
    Variant("async_op=True, then the future waited", SUM, "    dist.all_reduce(mine, async_op=True).get_future().wait()\n", 3),
    Variant("all_gather_object and Python's sum", SUM_BODY,
            "    values = [None] * dist.get_world_size()\n    dist.all_gather_object(values, value)\n"
            "    return sum(values)\n", 3),
    Variant("reduce to rank 0, then broadcast", SUM,
            "    dist.reduce(mine, dst=0)\n    dist.broadcast(mine, src=0)\n", 3),
    Variant("identity read from torchrun's variables",
            "rank, world_size = dist.get_rank(), dist.get_world_size()\n    local_rank",
            'rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])\n    local_rank', 3),
]

# Right on gloo, wrong on a GPU machine: seen when the check runs it again on a stand-in GPU
MUTATIONS += [
    Mutation("the tensor made without device=", "    mine = torch.tensor([value], device=device)\n",
             "    mine = torch.tensor([value])\n", "is made by `mine = torch.tensor([value])`", 2),
]
