"""Joining a process group, choosing backend and device, printing, and exiting cleanly.

Everything here works the same under torchrun and inside ranks forked from a notebook.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

# Every collective in the course has a timeout: a missing rank becomes an error, not a hang.
# The default of PyTorch is 10 to 30 minutes; ours is short because our jobs are small.
DEFAULT_TIMEOUT = timedelta(seconds=30)

# The environment that torchrun (and torch.distributed.launch) sets for every process.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Rank:
    """Who this process is in the job, and where its tensors live."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend(local_world_size: int | None = None) -> tuple[str, str]:
    """Return (backend, device type): nccl + cuda when every local rank can have its own GPU,
    gloo + cpu otherwise. Set RINGSIDE_BACKEND=gloo to force the CPU path on a GPU machine."""
    forced = os.environ.get("RINGSIDE_BACKEND")
    if forced == "gloo":
        return "gloo", "cpu"
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if forced == "nccl" and not enough_gpus:
        raise RuntimeError(
            f"RINGSIDE_BACKEND=nccl but only {torch.cuda.device_count()} CUDA device(s) "
            f"for {local_world_size} local ranks"
        )
    return ("nccl", "cuda") if enough_gpus else ("gloo", "cpu")


def device_for(device_type: str, local_rank: int) -> torch.device:
    """One GPU per local rank; every CPU rank simply uses the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def require_torchrun(script: str | None = None, nproc: int = 4) -> None:
    """Exit with status 2 and a how-to when a script meant for torchrun was started on its own."""
    if launched_by_torchrun():
        return
    script = script or sys.argv[0]
    missing = ", ".join(name for name in TORCHRUN_VARS if name not in os.environ)
    stem = Path(script).stem
    chapter = stem[:2] if stem[:2].isdigit() else "NN"
    print(
        f"{script} is a distributed program: it needs the variables that torchrun sets "
        f"(missing: {missing}).\n"
        f"Run it with\n"
        f"    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node {nproc} {script}\n"
        f"or from the course folder\n"
        f"    make lab CH={chapter} NPROC={nproc}",
        file=sys.stderr,
    )
    sys.exit(2)


def identity_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun set them."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(timeout: timedelta = DEFAULT_TIMEOUT) -> Rank:
    """Join the group that torchrun prepared (env://), with a timeout, on the right backend.

    Calling it again once the group exists just describes this process."""
    rank, world_size, local_rank = identity_from_env()
    backend, device_type = pick_backend()
    device = device_for(device_type, local_rank)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device_type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    return Rank(rank, world_size, local_rank, dist.get_backend(), device)


def attempt_store(rank: int, world_size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.Store:
    """A key-value store that only this attempt's ranks use, for init_process_group (chapter 11).

    Across restarts torchrun keeps ONE store for the whole job (TORCHELASTIC_USE_AGENT_STORE), and
    the ranks of a killed attempt leave their addresses in it: a restarted rank that read one would
    connect to a dead process. Numbering the attempts fails: TORCHELASTIC_RESTART_COUNT differs
    between nodes, and a count of joined ranks goes wrong for good once a rank dies before joining.
    So rank 0 starts a store of this attempt's own on a free port and posts the port in the job's
    store; a rank that reads a dead attempt's port cannot connect, and reads again."""
    import socket
    import time

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # a new store for every launch
        return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    job_store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:  # rank 0 runs on the node that hosts the job's store (MASTER_ADDR)
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        job_store.set("ringside/attempt_store_port", str(own.port))
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        own_port = int(job_store.get("ringside/attempt_store_port"))  # waits until rank 0 posted one
        try:  # a plain connection first: TCPStore would print pages of C++ errors for a dead port
            socket.create_connection((host, own_port), timeout=5).close()
            return dist.TCPStore(host, own_port, world_size, is_master=False, timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def finish(code: int = 0) -> NoReturn:
    """Leave the process group and exit at once with `code`.

    gloo ranks sometimes abort in the interpreter's own shutdown ("terminate called without an
    active exception") even after all their work is done; os._exit skips that shutdown. Flush
    first, because os._exit does not."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by a failed collective cannot be torn down cleanly
            pass
    flush()
    os._exit(code)


def print0(*args, **kwargs) -> None:
    """print on rank 0 only (or when there is no process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_ranked(text: str) -> None:
    """Every rank passes a line; rank 0 prints them all in rank order, so output is deterministic."""
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, str(text))
    if dist.get_rank() == 0:
        for rank, line in enumerate(lines):
            print(f"[rank {rank}] {line}", flush=True)
