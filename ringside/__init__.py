"""ringside: the small helper package that the course's chapters, labs and tests share.

Each module says in its docstring which chapter explains what it does.

- runtime:    join a process group (backend and device chosen for you), print from rank 0 or in
              rank order, and exit cleanly (`finish`); `attempt_store`, a store of each restart
              attempt's own (the capstone's `join_group`).                      chapters 00, 05, 11
- launch:     the one way the course starts processes: `run_ranks` (ranks from a notebook cell),
              `fork_processes`, `torchrun_script`, `torchrun_nodes`, `fork_script`, and
              `torchrun_command` under all the torchrun ones.                  chapter 00
- __main__:   `python -m ringside NPROC SCRIPT`, what `make lab` runs: the script's ranks as
              torchrun starts them, forked after one `import torch`.            every lab
- lab:        the labs' self-check (`run_lab`, `Checks`).                       every lab
- progress:   every learner's lab verdicts, for `make progress` and a workshop hub's `make room`.
- compare:    tensors compared with a stated tolerance, and a one-line reason when they differ.
- calls:      the one recorder of collectives and point-to-point calls at the c10d boundary
              (`Recorder`, `lab_namespaces`) for every lab check; `DryRun` rehearses with nothing sent.
- standin:    stand-in GPUs on a CPU (`StandInGPU`): tensors that live on cuda:k, CUDA's and
              NCCL's refusals of a tensor elsewhere, generators with their own state, so a
              check on a CPU judges what a GPU run would do.        labs 00-04, 08, 10
- data:       data sets that need no download (scikit-learn's digits file, a seeded regression).
- ring:       the ring all-reduce's schedule, pictures, cost model and measured results. chapter 04
- rendezvous: fresh rendezvous files, a simulated two-node job, listening sockets.  chapter 05
- syncbn:     synchronized BatchNorm for the capstone's CPU runs.                chapters 07, 11
- capstone:   the capstone's given parts (command line, data, network, log), so that
              lab 11's file holds only what it teaches.                         chapter 11

Maintainers' tools (lab generator, notebook executor, benches, the namespace cluster) live apart,
in the top-level folder tools/.
"""

import os
import sys
import warnings

# torch 2.14 renamed dist.reduce_scatter_tensor and dist.all_gather_into_tensor to *_single and warns
# on every rank at each call of the old names; torch 2.11 has only the old names. The course calls
# the old ones, which every torch it supports has, and silences just that warning.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                        r"is deprecated", category=FutureWarning)

# Ask NVML, not the CUDA driver, whether GPUs exist: the driver must not be initialized in a
# process (a Jupyter kernel) that later forks ranks.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from .lab import Checks, run_lab  # noqa: E402
from .launch import RankError, RanksTimeout, run_ranks, start_rank_starter  # noqa: E402
from .runtime import (  # noqa: E402
    DEFAULT_TIMEOUT,
    Rank,
    finish,
    init_distributed,
    pick_backend,
    print0,
    print_ranked,
    require_torchrun,
)

if "ipykernel" in sys.modules:  # a notebook will run ranks soon: start their starter now (seconds)
    start_rank_starter()

__all__ = [
    "Checks", "run_lab", "RankError", "RanksTimeout", "run_ranks", "DEFAULT_TIMEOUT", "Rank",
    "finish", "init_distributed", "pick_backend", "print0", "print_ranked", "require_torchrun",
]
