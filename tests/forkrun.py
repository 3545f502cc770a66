"""Run a lab or solution on N ranks by forking this (test) process, which has imported torch once.

Why: a torchrun launch costs one `import torch` per process (about 2 s of CPU each here), and the
suite launches scripts over a hundred times. Forked ranks start in milliseconds. They get the same
environment variables torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...)
and run the script as __main__, so the script cannot tell the difference. The real torchrun path is
still tested: every solution runs under torchrun at 4 ranks.

The test process must not have used OpenMP threads or initialized CUDA or a process group before
forking; conftest sets one thread, and tests never join a group themselves.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ringside.rendezvous import free_port


def _child(script: Path, args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked rank: fresh stdout/stderr files, torchrun's variables, run the script."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        os.environ.update(env)
        sys.argv = [str(script), *args]
        sys.path[0] = str(script.parent)
        runpy.run_path(str(script), run_name="__main__")
        code = 0  # a script that returns instead of calling finish()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def fork_run(script: Path, nproc: int, *args: str, timeout: float = 120,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Like `torchrun --standalone --nproc-per-node nproc script args`, returning every rank's
    output (rank 0 first) and status 1 if any rank failed (as torchrun does)."""
    port, workdir = free_port(), tempfile.mkdtemp(prefix="forkrun-")
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(nproc),
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": "forkrun", "OMP_NUM_THREADS": "1", **(env or {})}
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        rank_env = dict(shared, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        out, err = f"{workdir}/{rank}.out", f"{workdir}/{rank}.err"
        pid = os.fork()
        if pid == 0:
            _child(Path(script), list(map(str, args)), rank_env, out, err)
        pids.append(pid)
    codes = _wait(pids, timeout)
    read = lambda path: Path(path).read_text(errors="replace") if Path(path).exists() else ""  # noqa: E731
    stdout = "".join(read(f"{workdir}/{r}.out") for r in range(nproc))
    stderr = "".join(read(f"{workdir}/{r}.err") for r in range(nproc))
    if None in codes:
        running = [r for r, c in enumerate(codes) if c is None]
        raise subprocess.TimeoutExpired([str(script)], timeout, output=f"ranks {running} still running\n{stdout}")
    status = 0 if all(c == 0 for c in codes) else 1
    return subprocess.CompletedProcess([str(script), *args], status, stdout, stderr)


def _wait(pids: list[int], timeout: float) -> list[int | None]:
    """Exit codes in rank order; None for a rank killed at the deadline."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return [codes.get(pid) for pid in pids]
