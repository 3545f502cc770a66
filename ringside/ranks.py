"""Run a function on several ranks from inside a Jupyter kernel (or any Python process).

    results = run_ranks(hello, world_size=4)

Why not `torch.multiprocessing.spawn`? The spawn start method pickles the function by name and
cannot find functions defined in a notebook. So the ranks are *forked* from the kernel, meet
through a FileStore in a fresh temporary directory (no ports to collide), capture their own
output, and send it back with their return value. The kernel then prints every rank's output in
rank order: the same text on every run.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank raised an exception; the message holds its rank and traceback."""

    def __init__(self, rank: int, error: str, output: str = ""):
        self.rank, self.error, self.output = rank, error, output
        super().__init__(f"rank {rank} raised an exception:\n{error}")


class RanksTimeout(TimeoutError):
    """Some ranks had not finished when the time ran out (often a deadlock)."""

    def __init__(self, running: list[int], timeout: float, outputs: dict[int, str]):
        self.running, self.outputs = running, outputs
        names = ", ".join(str(r) for r in running)
        super().__init__(
            f"rank(s) {names} still running after {timeout:g} s and were killed: likely a "
            f"deadlock (a recv, wait or collective that another rank never joined)"
        )


def _worker(rank, world_size, fn, args, kwargs, store_path, backend, timeout_s, results, release):
    """Body of one forked rank: join the group, run fn, send back (status, value, output)."""
    torch.set_num_threads(1)  # ranks share the cores; one thread each avoids oversubscription
    output = io.StringIO()
    status, value = "ok", None
    try:
        with redirect_stdout(output), redirect_stderr(output):
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            value = fn(rank, world_size, *args, **kwargs)
    except BaseException:  # noqa: BLE001 - everything a rank raises goes back to the kernel
        status, value = "error", traceback.format_exc()
    try:
        payload = pickle.dumps((rank, status, value, output.getvalue()))
    except Exception:  # the return value could not be pickled
        payload = pickle.dumps((rank, "error", traceback.format_exc(), output.getvalue()))
    results.put(payload)
    results.close()
    results.join_thread()  # the queue's feeder thread must write the payload before os._exit
    # Stay in the group until every rank is done: a rank that left early would make a peer
    # still waiting on it fail with "connection closed" instead of showing the real problem.
    release.wait()
    # Leave without the interpreter's shutdown (see runtime.finish); a rank whose collective
    # failed may hold a broken group, so skip destroy_process_group there.
    if status == "ok" and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    os._exit(0)


def _print_outputs(outputs: dict[int, str]) -> None:
    for rank in sorted(outputs):
        for line in outputs[rank].splitlines():
            print(f"[rank {rank}] {line}")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 4,
    *args: Any,
    timeout: float = 60,
    backend: str = "gloo",
    show_output: bool = True,
    collective_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` forked ranks joined in one group.

    Returns the ranks' return values, in rank order. What the ranks print is shown afterwards,
    rank by rank, each line prefixed with "[rank r]" (show_output=False keeps it quiet).
    Raises RankError (with the rank and its traceback) if any rank raised, and RanksTimeout,
    after killing every rank, if some had not finished within `timeout` seconds.
    `collective_timeout` bounds each collective inside the ranks; by default it is longer than
    `timeout`, so that a deadlock is always reported as RanksTimeout, never as a race between the
    two limits."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialized in this kernel, and forked ranks cannot use it. "
            "Restart the kernel and create CUDA tensors only inside the rank function."
        )
    # DDP's first use imports torch._dynamo (hundreds of modules, seconds of CPU). Import it once
    # here, before forking, so that the ranks inherit it instead of each importing it again.
    importlib.import_module("torch._dynamo")

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    release = ctx.Event()
    tmpdir = tempfile.mkdtemp(prefix="ringside-")
    store_path = os.path.join(tmpdir, "store")
    collective_timeout = collective_timeout or timeout + 30
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, fn, args, kwargs, store_path, backend, collective_timeout, results, release),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        reports = _collect(procs, results, timeout)
    finally:
        release.set()  # ranks that reported now exit; ranks still running are killed
        grace = time.monotonic() + 3
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    outputs = {rank: out for rank, (_, _, out) in reports.items()}
    if show_output:
        _print_outputs(outputs)
    failed = [rank for rank in reports if reports[rank][0] == "error"]  # in order of arrival
    if failed:  # the first failure is the cause; ranks still waiting for it are its victims
        status, error, out = reports[failed[0]]
        raise RankError(failed[0], error, out)
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        raise RanksTimeout(missing, timeout, outputs)
    return [reports[r][1] for r in range(world_size)]


def _collect(procs, results, timeout: float) -> dict[int, tuple[str, Any, str]]:
    """Read every rank's report until all arrived, one rank died silently, or time ran out."""
    reports: dict[int, tuple[str, Any, str]] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value, out = pickle.loads(results.get(timeout=0.05))
            reports[rank] = (status, value, out)
            if status == "error":
                # One failed rank often leaves the others waiting for it: give them a moment
                # to fail too (their own collective timeout), then stop.
                deadline = min(deadline, time.monotonic() + 2.0)
            continue
        except queue_module.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank not in reports and not p.is_alive() and p.exitcode not in (0, None):
                reports[rank] = ("error", f"the process died with exit code {p.exitcode}", "")
    return reports
