"""Shared fixtures: where the course lives and how to launch its scripts (always with a timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parent.parent  # the course folder (ringside.launch.ROOT)
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cases")]


def pytest_configure(config):
    """Some tests fork processes from this one (launch.fork_processes): no OpenMP thread pool to copy,
    one thread per process where several share the cores, and what DDP (torch._dynamo) and the
    capstone (matplotlib) import on first use imported once here, not in every forked process.
    Not in pytest-xdist's controller, which runs no test: its imports would be seconds of CPU for
    nothing (scripts' ranks fork from the rank starter, which imports them itself)."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(1)
    import matplotlib.figure  # noqa: F401
    import torch._dynamo  # noqa: F401

# One 4-rank job takes about 6 s here; anything past this is a hang, not slowness.
LAUNCH_TIMEOUT = 240


def launch(script: Path, nproc: int, *args: str, timeout: float = LAUNCH_TIMEOUT,
           env: dict | None = None, torchrun: bool = False, nnodes: int = 1) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks; every rank's output, bounded by a timeout.

    By default the ranks are forked from this process (ringside.launch.fork_script: the same
    environment as torchrun gives, without importing torch again per rank); torchrun=True uses the
    real torchrun. nnodes > 1: `nproc` ranks on each of that many simulated nodes (forked only)."""
    from ringside.launch import fork_script, torchrun_script

    if Path(script).stem == "11_capstone" and "--out" not in args:
        # The capstone resumes from whatever checkpoint its --out folder holds, and tests run side
        # by side (pytest-xdist): each run gets a folder of its own, not the shared runs/capstone.
        args = (*args, "--out", tempfile.mkdtemp(prefix="capstone-"))
    try:
        if not torchrun:
            return fork_script(script, nproc, *args, timeout=timeout, env=env, nnodes=nnodes)
        return torchrun_script(script, nproc, *args, all_ranks=True, env=env, check=False, show=False,
                               timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = expired.output.decode(errors="replace") if isinstance(expired.output, bytes) else expired.output
        pytest.fail(f"{script} on {nproc} ranks still running after {timeout} s (a hang?):\n{(output or '')[-3000:]}")


FAULT_OPTIONS = {"--fail-at-step": "fail_at_step", "--fail-rank": "fail_rank", "--step-delay": "step_delay",
                 "--startup-delay": "startup_delay"}


def split_faults(args) -> tuple[list[str], dict[str, str]]:
    """template/train_ddp.py takes its test-only faults from RINGSIDE_TEST_FAULTS, not from options
    (they are not in the file practitioners copy as options): the tests still write them as
    `--fail-at-step 12 --fail-rank 1 --step-delay 0.3` among the arguments, and this moves them into
    that variable. (arguments without them, {"RINGSIDE_TEST_FAULTS": ...} or {})"""
    args, rest, faults = [str(a) for a in args], [], {}
    i = 0
    while i < len(args):
        if args[i] in FAULT_OPTIONS:
            key = FAULT_OPTIONS[args[i]]
            faults[key] = f"{faults[key]},{args[i + 1]}" if key in faults else args[i + 1]
            i += 2
        else:
            rest.append(args[i])
            i += 1
    return rest, ({"RINGSIDE_TEST_FAULTS": " ".join(f"{k}={v}" for k, v in faults.items())} if faults else {})


def solutions() -> list[Path]:
    return sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))


def stem_ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


@pytest.fixture(scope="session", autouse=True)
def suite_clock():
    start = time.monotonic()
    yield
    print(f"\n[suite] tests took {time.monotonic() - start:.0f} s")
