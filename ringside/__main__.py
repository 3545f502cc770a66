"""`python -m ringside NPROC SCRIPT [ARGS...]`: what `make lab` and `make solution` run.

torchrun on NPROC local ranks, showing every rank's output and ending with the lab's verdict
(see ringside.launch.run_for_learner)."""

import sys

from .launch import run_for_learner

if len(sys.argv) < 3 or not sys.argv[1].isdigit():
    sys.exit("usage: python -m ringside NPROC SCRIPT [ARGS...]   (or: make lab CH=04 NPROC=4)")
sys.exit(run_for_learner(sys.argv[2], int(sys.argv[1]), *sys.argv[3:]))
