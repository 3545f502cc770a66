"""Hello from every rank, started by torchrun: what the launcher tells each process.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 assets/00_setup/hello_torchrun.py
"""

import os

import torch
import torch.distributed as dist

from ringside import finish, init_distributed, print0, print_ranked

me = init_distributed()  # reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment
print_ranked(f"RANK={os.environ['RANK']} LOCAL_RANK={os.environ['LOCAL_RANK']} "
             f"WORLD_SIZE={os.environ['WORLD_SIZE']} backend={me.backend} device={me.device.type}")
total = torch.tensor([me.rank], device=me.device)
dist.all_reduce(total)
print0(f"sum of ranks: {int(total.item())}")
finish(0)  # leave the group and exit without the interpreter's shutdown (see the chapter)
