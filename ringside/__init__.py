"""ringside: the small helper package that the course's chapters, labs and tests share.

- runtime: join a process group (backend and device chosen for you), print from rank 0 or in
  rank order, and exit cleanly (`finish`).
- ranks:   run a function on N ranks from a notebook (`run_ranks`).
- lab:     the labs' self-check (`run_lab`, `Checks`).
- labgen:  write labs/ from solutions/.
- data:    data sets that need no download.
- compare: tensors compared with a stated tolerance, and a one-line reason when they differ.
"""

import os

# Ask NVML, not the CUDA driver, whether GPUs exist: the driver must not be initialized in a
# process (a Jupyter kernel) that later forks ranks.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from .lab import Checks, run_lab  # noqa: E402
from .ranks import RankError, RanksTimeout, run_ranks  # noqa: E402
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

__all__ = [
    "Checks", "run_lab", "RankError", "RanksTimeout", "run_ranks", "DEFAULT_TIMEOUT", "Rank",
    "finish", "init_distributed", "pick_backend", "print0", "print_ranked", "require_torchrun",
]
