"""The classic mistakes, planted in the solutions: each lab's check must catch them and say so.

Each chapter has a file tests/cases/NN_slug.py with
    MUTATIONS = [Mutation(what the mistake is, text in the solution, what replaces it,
                          words the diagnosis must contain, number of ranks), ...]
    CORRECT = [Variant(what is different, text in the solution, what replaces it, number of ranks)]
                        # optional: right answers written otherwise, which the check must pass
    NPROCS = (2, 4)     # optional: the rank counts its solution must pass at (default 1 to 4)
    REFUSES = (1,)      # optional: rank counts its check cannot tell right from wrong: it must refuse them
    NODES = True        # optional: it reads LOCAL_RANK, picks a device or works on rank 0 only: run it
                        # at 2 nodes x 2 ranks too (RANK != LOCAL_RANK)
    ARGS = ("--epochs", "2")  # optional: arguments for every mutated run (a shorter one, say)
    SLOW = True         # optional: its runs are long (training, timeouts): make test starts them first
The original text must occur exactly once in the solution.
"""

import functools
import importlib.util
from pathlib import Path

from typing import NamedTuple


class Mutation(NamedTuple):
    name: str
    old: str
    new: str
    diagnosis: str
    nproc: int = 2


class Variant(NamedTuple):
    """Correct code written otherwise than the solution: the check must pass it (CORRECT = [...])."""
    name: str
    old: str
    new: str
    nproc: int = 2




@functools.cache
def chapter_cases() -> dict[str, object]:
    """stem -> the module tests/cases/<stem>.py, for every chapter that has one. Read once per
    process: collection asks for one chapter's settings once per test (391 mutations x 17 files
    compiled again each time cost a pytest worker most of a minute of CPU)."""
    modules = {}
    for path in sorted(Path(__file__).parent.glob("[0-9][0-9]_*.py")):
        spec = importlib.util.spec_from_file_location(f"cases_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[path.stem] = module
    return modules


def mutations() -> dict[str, list[Mutation]]:
    return {stem: list(getattr(m, "MUTATIONS", [])) for stem, m in chapter_cases().items()}


def variants() -> dict[str, list[Variant]]:
    return {stem: list(getattr(m, "CORRECT", [])) for stem, m in chapter_cases().items()}


def nprocs(stem: str) -> tuple[int, ...]:
    module = chapter_cases().get(stem)
    return tuple(getattr(module, "NPROCS", (1, 2, 3, 4)))


def refuses(stem: str) -> tuple[int, ...]:
    return tuple(getattr(chapter_cases().get(stem), "REFUSES", ()))


def two_nodes(stem: str) -> bool:
    return bool(getattr(chapter_cases().get(stem), "NODES", False))


def slow(stem: str) -> bool:
    return bool(getattr(chapter_cases().get(stem), "SLOW", False))


def args(stem: str) -> tuple[str, ...]:
    return tuple(getattr(chapter_cases().get(stem), "ARGS", ()))
