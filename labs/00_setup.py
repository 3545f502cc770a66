"""Lab 00 - setup: every rank introduces itself, in rank order, and the ranks add up their numbers.

Run it with 4 processes:
    make lab CH=00 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/00_setup.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/00_setup.py; edit that one.)

import os

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print_ranked, run_lab


def describe_me() -> str:
    """One line that says who this process is, e.g. "rank 2 of 4, local rank 2, backend gloo"."""
    # TODO: ask torch.distributed for the rank, world size and backend, and os.environ for LOCAL_RANK
    raise NotImplementedError("the TODO above")


def sum_of_ranks(device: torch.device) -> int:
    """Every rank contributes its own rank number; return the total, the same on every rank."""
    # TODO: put this rank's number in a tensor on `device`, all_reduce it with SUM, return the result
    raise NotImplementedError("the TODO above")


def check_introductions(checks: Checks, line: str) -> None:
    """Every rank must have spoken and named its own rank and the world size."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lines = [None] * world_size
    dist.all_gather_object(lines, line)
    for other, text in enumerate(lines):
        checks.expect(
            isinstance(text, str) and f"rank {other} of {world_size}" in text,
            f"rank {other} introduced itself as {text!r}; expected it to contain 'rank {other} of "
            f"{world_size}' - read dist.get_rank() and dist.get_world_size(), not constants",
        )
    checks.expect(f"local rank {os.environ['LOCAL_RANK']}" in line,
                  f"{line!r} does not name local rank {os.environ['LOCAL_RANK']} - read os.environ['LOCAL_RANK']")


def check_sum(checks: Checks, total: int) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    expected = world_size * (world_size - 1) // 2
    if total == rank:
        hint = "it is just this rank's own number - did you call dist.all_reduce?"
    elif total == world_size - 1:
        hint = "that is the largest rank - did you reduce with MAX instead of SUM?"
    else:
        hint = "every rank should add its rank number with dist.all_reduce(tensor, op=SUM)"
    checks.expect(total == expected, f"the sum over ranks is {total}, expected 0+1+...+{world_size - 1} = {expected}: {hint}")


def main(me: Rank, checks: Checks) -> None:
    # run_lab has joined the group that torchrun set up (chapter 05 shows how) and passes `me`
    line = describe_me()
    print_ranked(line)  # rank 0 prints every rank's line, in rank order
    check_introductions(checks, line)
    total = sum_of_ranks(me.device)
    if me.is_main:
        print(f"sum of ranks: {total}")
    check_sum(checks, total)


if __name__ == "__main__":
    run_lab(main, title="Lab 00 (setup)")
