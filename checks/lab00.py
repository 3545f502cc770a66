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
from ringside.calls import Recorder, lab_namespaces
from ringside.effects import device_problem, never_waited, passed_on_every_rank, rank_gpu, unwaited_diagnosis

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


def check_on_a_node_of_its_own(checks: Checks) -> None:
    """A second node, rehearsed: each rank told it is local rank 0 of a node of its own (as torchrun
    numbers a job of world_size nodes x 1 rank). The line must follow LOCAL_RANK, not the global rank
    (on one node the two are equal, so a global rank used as the local one never shows otherwise)."""
    rank = dist.get_rank()
    saved = {name: os.environ.get(name) for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    try:
        line = lab.describe_me()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    checks.expect(isinstance(line, str) and "local rank 0" in line and f"rank {rank} of " in line,
                  f"on a second node (rank {rank} there is local rank 0, LOCAL_RANK=0) it introduced itself as "
                  f"{line!r} - the local rank is the process's number on its own node: read "
                  f"os.environ['LOCAL_RANK'], not the global rank")


# Inputs chosen so that SUM differs from MAX, MIN, PRODUCT and the mean at every world size,
# 2 included (where the ranks 0 and 1 alone give 0+1 = max(0, 1)).
def values_for(case: int, rank: int) -> int:
    return (10 * rank + 3, -7 * rank - 2, rank)[case]


def diagnose_sum(totals: list, values: list[int]) -> str:
    """What the totals are, if not the sum, and the likely mistake: a mistake is named only when its
    prediction matches what every rank returned (rank 2's own value may be the largest too)."""
    world_size = len(values)
    product = 1
    for v in values:
        product *= v
    every = lambda predicted: all(t == p for t, p in zip(totals, predicted))  # noqa: E731
    same = lambda x: [x] * world_size  # noqa: E731
    fits = []
    if every(values):
        fits.append("each rank's own value - did you call dist.all_reduce, and read the result from the "
                    "same tensor you passed to it (it works in place; a copy or a new tensor keeps the old value)?")
    if every(same(max(values))):
        fits.append("the largest value - did you reduce with MAX instead of SUM?")
    if every(same(min(values))):
        fits.append("the smallest value - did you reduce with MIN instead of SUM?")
    if every(same(product)):
        fits.append("the product - did you reduce with PRODUCT instead of SUM?")
    if world_size > 1 and all(t is not None and (t * world_size == sum(values) or t == sum(values) // world_size)
                              for t in totals):
        fits.append(f"the mean - did you divide by world_size ({world_size})? The sum is asked for")
    if every(same(sum(range(world_size)))) and sum(range(world_size)) != sum(values):
        fits.append("0+1+...+N-1 - you added the rank numbers, not the values passed in")
    if totals[0] == sum(values) and not every(same(sum(values))):
        fits.append("right on rank 0 only - dist.reduce leaves the sum on one rank; all_reduce leaves it on "
                    "every rank")
    if fits:
        return "it is " + " or ".join(fits)
    wrong = [r for r, t in enumerate(totals) if t != sum(values)]
    return (f"the ranks returned {totals} (wrong on {'rank' if len(wrong) == 1 else 'ranks'} "
            f"{', '.join(map(str, wrong))}) - every rank must return the sum of all ranks' values")


def check_sum(checks: Checks, device: torch.device) -> None:
    """Three sets of values (positive, negative, the rank numbers) against Python's sum; exact (ints).
    Observed: what each rank returns, and that the caller's value is an int it keeps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for case in range(3):
        values = [values_for(case, r) for r in range(world_size)]
        with Recorder(namespaces=lab_namespaces(lab.sum_over_ranks)) as calls:
            total = lab.sum_over_ranks(values[rank], device)
        unwaited = unwaited_diagnosis("sum_over_ranks", calls.calls)
        for call in never_waited(calls.calls):  # finished here, so the check's own messages do not meet it
            if call.get("work") is not None:
                call.work.wait()
        if unwaited:  # an effect whatever value it happened to read: on another run, another value
            checks.fail(f"{unwaited} (read before it arrives, the same code gives the sum on one run and a "
                        f"rank's own value on the next)")
            return
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
        steps = [f"call it yourself as the check did (rank r passes the r-th of {values}) and print what "
                 f"every rank returns: ringside.print_ranked(str(sum_over_ranks(value, device)))",
                 f"all {world_size} ranks must return {expected}, here they returned {totals}: look at which "
                 f"collective and which reduce op made them, and from which tensor you read the result"]
        checks.expect(total == expected, f"with values {values} on the ranks, sum_over_ranks gave "
                                         f"{total}, expected {expected}: {diagnose_sum(totals, values)}", steps)
        if any(t != expected for t in totals):  # every rank stops at the first case wrong anywhere
            return
        checks.expect(type(total) is int or (isinstance(total, int) and not isinstance(total, bool)),
                      f"sum_over_ranks returned a {type(total).__name__} ({total!r}): return a Python int")


def main(me: Rank, checks: Checks) -> None:
    # run_lab has joined the group that torchrun set up (chapter 05 shows how) and passes `me`
    line = lab.describe_me()
    print_ranked(line)  # rank 0 prints every rank's line, in rank order
    check_introduction(checks, line)
    if not checks.failures:
        check_on_a_node_of_its_own(checks)
    total = lab.sum_over_ranks(me.rank, me.device)
    if me.is_main:
        print(f"sum of ranks: {total}")
    check_sum(checks, me.device)
    if passed_on_every_rank(checks):
        check_on_gpu(checks)


def check_on_gpu(checks: Checks) -> None:
    """sum_over_ranks once more as `make lab` runs it on a GPU machine: `device` this rank's stand-in
    GPU, NCCL's rules for what a collective accepts (ringside.effects.rank_gpu). A tensor made on the
    CPU is named where it is made."""
    with rank_gpu(lab.sum_over_ranks) as (gpu, _):
        _, problem = device_problem("sum_over_ranks", check_sum, checks, gpu.device)
        checks.expect(problem is None, problem or "")


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 00 (setup)")
