"""How processes find each other (chapter 05): free ports, fresh rendezvous files, processes forked
with a time limit, a simulated multi-node torchrun job, and what a port is listening on.

Everything here is bounded: a process that does not finish in time is killed and reported as such.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .launch import ROOT, quiet_env

WHOAMI = ROOT / "assets" / "05_init_methods" / "whoami.py"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago: bind to port 0 and let the kernel choose one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fresh_file() -> str:
    """A path for a file:// rendezvous that does not exist yet (a used one would break the next run)."""
    return os.path.join(tempfile.mkdtemp(prefix="ringside-rdzv-"), "rendezvous")


class Outcome(NamedTuple):
    """What one forked process did: status is "ok", "error" or "killed"."""

    rank: int
    status: str
    detail: str  # the return value (ok), "ExceptionType: message" (error), or why it was killed

    def says(self, *phrases: str) -> str:
        """A line that does not change between runs: the status and the first phrase found."""
        if self.status == "ok":
            return f"ok: {self.detail}"
        if self.status == "killed":
            return self.detail
        kind = self.detail.split(":", 1)[0]
        found = next((p for p in phrases if p.lower() in self.detail.lower()), None)
        return f"{kind}: ...{found}..." if found else f"{kind} (unexpected message: {self.detail[:200]})"


def _child(fn, rank, n, args, results):
    # Silence the child: PyTorch's C++ warnings (with time stamps) would otherwise reach the
    # notebook through file descriptor 2. What the child has to say goes back on the queue.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = sys.stderr = io.StringIO()
    try:
        value = fn(rank, n, *args)
        results.put((rank, "ok", str(value)))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}"))
    results.close()
    results.join_thread()
    os._exit(0)  # no interpreter shutdown in the child (see runtime.finish)


def fork_processes(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 10) -> list[Outcome]:
    """Run fn(rank, n, *args) in n forked processes; each either returns, raises, or is killed
    after `timeout` seconds. Unlike run_ranks, no group is formed: joining one is the lesson."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, n, args, results), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < n and time.monotonic() < deadline:
        try:
            rank, status, detail = results.get(timeout=0.05)
            outcomes[rank] = Outcome(rank, status, detail)
        except queue_module.Empty:
            pass
    for rank, p in enumerate(procs):
        p.join(timeout=0.5 if rank in outcomes else 0)
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
        if rank not in outcomes:
            outcomes[rank] = Outcome(rank, "killed", f"still waiting after {timeout:g} s: killed")
    results.close()
    return [outcomes[r] for r in range(n)]


def listening_addresses(port: int) -> list[str] | None:
    """The local addresses a TCP port listens on, read from /proc (Linux); None elsewhere.
    "0.0.0.0" or "::" mean every network interface of the machine, not only loopback."""
    found = []
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                if width == 8:
                    found.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
                else:  # four little-endian 32-bit words
                    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8))
                    found.append(socket.inet_ntop(socket.AF_INET6, raw))
    return sorted(set(found))


def loopback_listener() -> socket.socket:
    """A listening socket bound to 127.0.0.1 only, for TCPStore(master_listen_fd=...)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def node_command(script: Path, nnodes: int, node_rank: int, nproc: int, endpoint: str, run_id: str,
                 *args: str) -> list[str]:
    """One "node" of a multi-node job: torchrun with a c10d rendezvous at `endpoint`."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", str(script), *args]


def simulate_nodes(script: Path = WHOAMI, nnodes: int = 2, nproc: int = 2, *args: str,
                   timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start `nnodes` torchrun processes on this machine as if each were a node; all meet at a
    c10d rendezvous on 127.0.0.1. Returns each node's result; all are killed after `timeout` s."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = uuid.uuid4().hex[:8]
    env = quiet_env()
    procs = [subprocess.Popen(node_command(script, nnodes, node, nproc, endpoint, run_id, *args),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(nnodes)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for cmd_procs in procs:
            out, err = cmd_procs.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(cmd_procs.args, cmd_procs.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


TABLE_LINE = re.compile(r"^rank \d+ ")


def identity_table(results: list[subprocess.CompletedProcess]) -> list[str]:
    """The lines of whoami.py's table (printed by global rank 0, on whichever node it ran)."""
    return [line for r in results for line in r.stdout.splitlines() if TABLE_LINE.match(line)]


def spawned_worker(index: int, world_size: int, port: int, results) -> None:
    """For torch.multiprocessing.spawn: it starts fresh interpreters that import this function by
    name, so it must live in a module (a function defined in a notebook cannot be found)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world_size,
                            timeout=timedelta(seconds=30))
    total = torch.tensor([index])
    dist.all_reduce(total)
    results.put((index, os.getppid(), total.item()))  # the parent's process id: the launcher
    dist.destroy_process_group()
    os._exit(0)  # see runtime.finish


@contextmanager
def native_warnings_silenced():
    """Hide what PyTorch's C++ layer writes to file descriptor 2 inside the block (its warnings
    carry a time stamp and a port, which would change a notebook's output on every run)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
