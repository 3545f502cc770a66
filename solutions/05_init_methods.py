"""Lab 05 - init_methods: join a process group from command-line settings (tcp://, file://, env://),
and fail fast, with a message that says what to fix, when the settings cannot work.

Run it with 4 processes:
    make lab CH=05 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/05_init_methods.py)

The check forms the group three times, once per init method, and tries bad settings on the way.
The backend is gloo throughout: the rendezvous is the lesson, and it is the same for nccl.
"""
# SOLUTION FILE

import argparse
import os
from datetime import timedelta
from typing import Mapping, NamedTuple
from urllib.parse import urlparse

import torch.distributed as dist


class Settings(NamedTuple):
    init_method: str  # tcp://HOST:PORT, file:///absolute/path or env://
    rank: int
    world_size: int
    timeout_s: float


class BadSettings(ValueError):
    """Settings that cannot form a group; the message says what is wrong and how to fix it."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Join a process group.")
    parser.add_argument("--init-method", default="env://", help="tcp://HOST:PORT, file:///path or env://")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: $RANK)")
    parser.add_argument("--world-size", type=int, default=None, help="number of processes (default: $WORLD_SIZE)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the others")
    return parser.parse_args(argv)


def settings_from_args(argv: list[str], environ: Mapping[str, str] = os.environ) -> Settings:
    """Read the settings from argv (and, for what argv leaves out, from torchrun's environment).

    Raise BadSettings, naming the problem, when:
    - the init method is not tcp://, file:// or env://;
    - tcp:// lacks HOST:PORT, or the port is not in 1..65535;
    - file:// has no absolute path (file:///tmp/x), or its folder does not exist;
    - env:// is chosen but MASTER_ADDR or MASTER_PORT is not set;
    - the rank or the world size is given neither as --rank/--world-size nor as RANK/WORLD_SIZE
      (the command line wins over the environment);
    - the rank is not in 0..world_size-1, or the timeout is not positive.
    """
    args = parse_args(argv)
    method = args.init_method
    # HINT 1: urllib.parse.urlparse(method) gives .scheme, .hostname and .port (reading .port raises ValueError above 65535); os.path.isdir checks a folder
    # HINT 2: read `environ`, never os.environ (the check passes its own); test `args.rank is not None` (`args.rank or ...` would treat rank 0 as missing), else look in environ
    # BEGIN SOLUTION: return the Settings that argv (first) and `environ` (for what argv leaves out) describe, or raise BadSettings with a message that says what to fix, in every case the docstring lists
    scheme = method.split("://", 1)[0] if "://" in method else ""
    if scheme == "tcp":
        url = urlparse(method)
        try:
            port = url.port
        except ValueError:  # urlparse refuses ports above 65535
            port = None
        if not url.hostname or port is None or not 0 < port < 65536:
            raise BadSettings(f"{method!r}: tcp:// needs HOST:PORT with a port in 1..65535, "
                              f"e.g. tcp://127.0.0.1:29500")
    elif scheme == "file":
        path = method[len("file://"):]
        if not path.startswith("/"):
            raise BadSettings(f"{method!r}: file:// needs an absolute path, with three slashes: "
                              f"file:///tmp/rendezvous")
        if not os.path.isdir(os.path.dirname(path)):
            raise BadSettings(f"{method!r}: the folder {os.path.dirname(path)} does not exist")
    elif scheme == "env":
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
        if missing:
            raise BadSettings(f"env:// needs {' and '.join(missing)} in the environment "
                              f"(torchrun sets them; without torchrun, export them)")
    else:
        raise BadSettings(f"unknown init method {method!r}: use tcp://HOST:PORT, file:///path or env://")

    rank = args.rank if args.rank is not None else environ.get("RANK")
    world_size = args.world_size if args.world_size is not None else environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        raise BadSettings("no rank or world size: pass --rank and --world-size, "
                          "or set RANK and WORLD_SIZE (torchrun does)")
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise BadSettings(f"rank {rank} is out of range for world size {world_size}: "
                          f"ranks go from 0 to world_size - 1")
    if args.timeout <= 0:
        raise BadSettings(f"--timeout {args.timeout:g}: the timeout must be a positive number of seconds")
    return Settings(method, rank, world_size, args.timeout)
    # END SOLUTION


def init_from_args(argv: list[str], environ: Mapping[str, str] = os.environ) -> Settings:
    """Join the default process group (gloo) as the settings say, and return them.
    A group that cannot form must fail within settings.timeout_s seconds, never hang."""
    settings = settings_from_args(argv, environ)
    # HINT 1: dist.init_process_group takes init_method, rank, world_size and timeout; its default timeout is 30 minutes
    # HINT 2: timeout wants a datetime.timedelta: timedelta(seconds=settings.timeout_s)
    # BEGIN SOLUTION: join the default group with the gloo backend exactly as `settings` say, so that a group that cannot form fails within settings.timeout_s seconds
    dist.init_process_group("gloo", init_method=settings.init_method, rank=settings.rank,
                            world_size=settings.world_size, timeout=timedelta(seconds=settings.timeout_s))
    # END SOLUTION
    return settings


if __name__ == "__main__":  # the check is in checks/lab05.py: you need not read it
    from checks import lab05
    lab05.run(Settings=Settings, BadSettings=BadSettings, settings_from_args=settings_from_args,
              init_from_args=init_from_args)
