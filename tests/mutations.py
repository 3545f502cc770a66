"""The classic mistakes, planted in the solutions: each lab's check must catch them and say so.

Each entry: (what the mistake is, text in the solution, what replaces it, words the diagnosis
must contain, number of ranks). The original text must occur exactly once in the solution.
Chapters add their own rows; test_mutations.py runs them all.
"""

from typing import NamedTuple


class Mutation(NamedTuple):
    name: str
    old: str
    new: str
    diagnosis: str
    nproc: int = 2


MUTATIONS: dict[str, list[Mutation]] = {
    "00_setup": [
        Mutation("no all_reduce", "    dist.all_reduce(mine, op=dist.ReduceOp.SUM)\n", "",
                 "did you call dist.all_reduce?", 4),
        Mutation("MAX instead of SUM", "op=dist.ReduceOp.SUM)", "op=dist.ReduceOp.MAX)",
                 "did you reduce with MAX instead of SUM?", 4),
        Mutation("hard-coded rank", "rank, world_size = dist.get_rank(), dist.get_world_size()\n    local_rank",
                 "rank, world_size = 0, dist.get_world_size()\n    local_rank",
                 "read dist.get_rank() and dist.get_world_size(), not constants"),
    ],
}
