"""The check of lab 00 (setup): it runs the code of labs/00_setup.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print_ranked, run_lab

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------

def check_introduction(checks: Checks, line: str) -> None:
    """This rank's line must name its own rank, the world size and its local rank."""
    local_rank = os.environ["LOCAL_RANK"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not isinstance(line, str):
        checks.fail(f"describe_me() returned a {type(line).__name__}, not a str")
        return
    checks.expect(f"rank {rank} of {world_size}" in line,
                  f"introduced itself as {line!r}; expected it to contain 'rank {rank} of {world_size}' - "
                  f"read dist.get_rank() and dist.get_world_size(), not constants")
    checks.expect(f"local rank {local_rank}" in line,
                  f"{line!r} does not name local rank {local_rank} - read os.environ['LOCAL_RANK']")
    checks.expect(f"backend {dist.get_backend()}" in line,
                  f"{line!r} does not name the backend {dist.get_backend()!r} - ask dist.get_backend()")


# Inputs chosen so that SUM differs from MAX, MIN, PRODUCT and the mean at every world size,
# 2 included (where the ranks 0 and 1 alone give 0+1 = max(0, 1)).
def values_for(case: int, rank: int) -> int:
    return (10 * rank + 3, -7 * rank - 2, rank)[case]


def diagnose_sum(total, values: list[int], mine: int) -> str:
    """What `total` is, if not the sum, and the likely mistake."""
    world_size = len(values)
    product = 1
    for v in values:
        product *= v
    fits = []
    if total == mine:
        fits.append("this rank's own value - did you call dist.all_reduce, and read the result from the "
                    "same tensor you passed to it (it works in place; a copy or a new tensor keeps the old value)?")
    if total == max(values):
        fits.append("the largest value - did you reduce with MAX instead of SUM?")
    if total == min(values):
        fits.append("the smallest value - did you reduce with MIN instead of SUM?")
    if total == product:
        fits.append("the product - did you reduce with PRODUCT instead of SUM?")
    if world_size > 1 and (total * world_size == sum(values) or total == sum(values) // world_size):
        fits.append(f"the mean - did you divide by world_size ({world_size})? The sum is asked for")
    if total == sum(range(world_size)) != sum(values):
        fits.append("0+1+...+N-1 - you added the rank numbers, not the values passed in")
    return " or ".join(fits) if fits else "add every rank's value with dist.all_reduce(t, op=dist.ReduceOp.SUM)"


def check_sum(checks: Checks, device: torch.device) -> None:
    """Three sets of values (positive, negative, the rank numbers) against Python's sum; exact (ints)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for case in range(3):
        values = [values_for(case, r) for r in range(world_size)]
        total = lab.sum_over_ranks(values[rank], device)
        if isinstance(total, torch.Tensor):
            checks.fail(f"sum_over_ranks returned a tensor {total}: return a Python int (int(t.item()))")
            return
        if total is None:  # e.g. `return dist.all_reduce(t)`: the collective works in place, returns None
            checks.fail("sum_over_ranks returned None - dist.all_reduce(t) changes t in place and returns "
                        "None (a Work only with async_op=True): return int(t.item()) after it")
            return
        expected = sum(values)
        totals = [None] * world_size
        dist.all_gather_object(totals, total)
        if total != expected and totals[0] == expected:
            hint = ("right on rank 0 only - dist.reduce leaves the sum on one rank; all_reduce leaves it on "
                    "every rank")
        else:
            hint = diagnose_sum(total, values, values[rank])
        checks.expect(total == expected, f"with values {values} on the ranks, sum_over_ranks gave "
                                         f"{total}, expected {expected}: it is {hint}")
        if any(t != expected for t in totals):  # every rank stops at the first case wrong anywhere
            return


def main(me: Rank, checks: Checks) -> None:
    # run_lab has joined the group that torchrun set up (chapter 05 shows how) and passes `me`
    line = lab.describe_me()
    print_ranked(line)  # rank 0 prints every rank's line, in rank order
    check_introduction(checks, line)
    total = lab.sum_over_ranks(me.rank, me.device)
    if me.is_main:
        print(f"sum of ranks: {total}")
    check_sum(checks, me.device)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 00 (setup)")
