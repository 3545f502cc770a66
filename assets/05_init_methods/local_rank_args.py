"""The old launcher's --local-rank argument against the seeds' argparse line, and the fix.

    python -m torch.distributed.launch --nproc-per-node=1 assets/05_init_methods/local_rank_args.py
    (with LOCAL_RANK_ARGS=fixed in the environment: the fixed parser)
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
if os.environ.get("LOCAL_RANK_ARGS") == "fixed":
    # Accept both spellings, and fall back to the environment, which every launcher sets.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
else:
    parser.add_argument("--local_rank", type=int, default=0)  # the seeds' line, written before torch 2.0
args = parser.parse_args()
print(f"arguments: {sys.argv[1:]}; LOCAL_RANK in the environment: {os.environ.get('LOCAL_RANK')}; "
      f"args.local_rank = {args.local_rank}")
