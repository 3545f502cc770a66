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


def describe_me() -> str:
    """One line that says who this process is, e.g. "rank 2 of 4, local rank 2, backend gloo"."""
    # (stuck? `make hint CH=00` prints hint 1 of 2; run it again for the next)
    # TODO: return the line of the docstring, with this process's own rank, world size, local rank and backend, read at run time (no constants)
    raise NotImplementedError("the TODO above")


def sum_over_ranks(value: int, device: torch.device) -> int:
    """Every rank calls this with its own `value`; return the sum of all ranks' values, as a
    Python int, the same on every rank. Tensors that a collective touches live on `device`."""
    # (stuck? `make hint CH=00` prints hint 1 of 2; run it again for the next)
    # TODO: add up every rank's `value` with one collective, and return the total on every rank
    raise NotImplementedError("the TODO above")


if __name__ == "__main__":  # the check is in checks/lab00.py: you need not read it
    from checks import lab00
    lab00.run(describe_me=describe_me, sum_over_ranks=sum_over_ranks)
