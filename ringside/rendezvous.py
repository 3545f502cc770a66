"""How processes find each other (chapter 05): fresh rendezvous files, a simulated multi-node
torchrun job, what a port is listening on, and a worker for mp.spawn. Processes are started by
ringside.launch (fork_processes, free_port, torchrun_command and torchrun_nodes come from there).

Everything here is bounded: a process that does not finish in time is killed and reported as such.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from .launch import (ROOT, Outcome, fork_processes, free_port, reserved_port, torchrun_command,  # noqa: F401
                     torchrun_nodes)

WHOAMI = ROOT / "assets" / "05_init_methods" / "whoami.py"


def fresh_file() -> str:
    """A path for a file:// rendezvous that does not exist yet (a used one would break the next run)."""
    return os.path.join(tempfile.mkdtemp(prefix="ringside-rdzv-"), "rendezvous")


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


def simulate_nodes(script: Path = WHOAMI, nnodes: int = 2, nproc: int = 2, *args: str,
                   timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start `nnodes` torchrun processes on this machine as if each were a node; all meet at a
    c10d rendezvous on 127.0.0.1. Returns each node's result; all are killed after `timeout` s."""
    with reserved_port() as port:
        endpoint, run_id = f"127.0.0.1:{port}", uuid.uuid4().hex[:8]
        return torchrun_nodes([torchrun_command(script, nproc, *args, all_ranks=True, nnodes=nnodes, node_rank=node,
                                                rdzv_endpoint=endpoint, run_id=run_id)
                               for node in range(nnodes)], timeout)


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
