"""Execute chapter notebooks in place, so their stored outputs are what the code prints now.

Usage (maintainers): python tools/notebooks.py chapters/04_ring_allreduce.ipynb [...]
nbval then compares a fresh run against these stored outputs in `make test`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 600) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    print(f"executed {path}")


if __name__ == "__main__":
    # as make test runs them: one OpenMP thread per process (a kernel's thread count changes the
    # order of float additions: chapter 16's "bit for bit at 1 rank" is False with more threads)
    os.environ["OMP_NUM_THREADS"] = "1"
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path("chapters").glob("[0-9][0-9]_*.ipynb"))
    for p in paths:
        execute(p)
