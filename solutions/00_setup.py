"""Lab 00 - setup: every rank introduces itself, in rank order, and the ranks add up their numbers.

Run it with 4 processes:
    make lab CH=00 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/00_setup.py)
"""
# SOLUTION FILE

import os

import torch
import torch.distributed as dist


def describe_me() -> str:
    """One line that says who this process is, e.g. "rank 2 of 4, local rank 2, backend gloo"."""
    # HINT 1: torch.distributed knows this process's rank, the world size and the backend; torchrun put the local rank in an environment variable
    # HINT 2: dist.get_rank(), dist.get_world_size(), dist.get_backend() and int(os.environ["LOCAL_RANK"])
    # BEGIN SOLUTION: return the line of the docstring, with this process's own rank, world size, local rank and backend, read at run time (no constants)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    return f"rank {rank} of {world_size}, local rank {local_rank}, backend {dist.get_backend()}"
    # END SOLUTION


def sum_over_ranks(value: int, device: torch.device) -> int:
    """Every rank calls this with its own `value`; return the sum of all ranks' values, as a
    Python int, the same on every rank. Tensors that a collective touches live on `device`."""
    # HINT 1: one collective both adds the ranks' tensors and leaves the result on every rank; it works in place
    # HINT 2: t = torch.tensor([value], device=device); dist.all_reduce(t, op=dist.ReduceOp.SUM); return int(t.item())
    # BEGIN SOLUTION: add up every rank's `value` with one collective, and return the total on every rank
    mine = torch.tensor([value], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.SUM)
    return int(mine.item())
    # END SOLUTION


if __name__ == "__main__":  # the check is in checks/lab00.py: you need not read it
    from checks import lab00
    lab00.run(describe_me=describe_me, sum_over_ranks=sum_over_ranks)
