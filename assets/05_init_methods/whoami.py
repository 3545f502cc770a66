"""Every process says who it is; global rank 0 prints the table in rank order.

Launched by torchrun (one or several "nodes") or by the old torch.distributed.launch, which
passes --local-rank=N as an argument instead of setting LOCAL_RANK.
"""

import os
import sys

import torch.distributed as dist

from ringside import finish, init_distributed

# torch.distributed.launch (without --use-env) appends --local-rank=N (older versions: --local_rank=N)
arg = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(("--local-rank=", "--local_rank="))), "-")
if "LOCAL_RANK" not in os.environ and arg != "-":
    os.environ["LOCAL_RANK"] = arg  # what every script written for the old launcher had to do

me = init_distributed()
env = {name: os.environ.get(name, "-") for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE",
                                                    "LOCAL_WORLD_SIZE")}
rows = [None] * me.world_size
dist.all_gather_object(rows, (env, arg))
if me.is_main:
    for env, arg in rows:
        print(f"rank {env['RANK']} = group_rank {env['GROUP_RANK']} x local_world_size "
              f"{env['LOCAL_WORLD_SIZE']} + local_rank {env['LOCAL_RANK']}   "
              f"(world_size {env['WORLD_SIZE']}, --local-rank argument: {arg})")
finish(0)
