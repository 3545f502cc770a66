"""Lab 05 - init_methods: join a process group from command-line settings (tcp://, file://, env://),
and fail fast, with a message that says what to fix, when the settings cannot work.

Run it with 4 processes:
    make lab CH=05 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/05_init_methods.py)

The check forms the group three times, once per init method, and tries bad settings on the way.
The backend is gloo throughout: the rendezvous is the lesson, and it is the same for nccl.
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/05_init_methods.py; edit that one.)

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
    # (stuck? `make hint CH=05` prints hint 1 of 2; run it again for the next)
    # TODO: return the Settings that argv (first) and `environ` (for what argv leaves out) describe, or raise BadSettings with a message that says what to fix, in every case the docstring lists
    raise NotImplementedError("the TODO above")


def init_from_args(argv: list[str], environ: Mapping[str, str] = os.environ) -> Settings:
    """Join the default process group (gloo) as the settings say, and return them.
    A group that cannot form must fail within settings.timeout_s seconds, never hang."""
    settings = settings_from_args(argv, environ)
    # (stuck? `make hint CH=05` prints hint 1 of 2; run it again for the next)
    # TODO: join the default group with the gloo backend exactly as `settings` say, so that a group that cannot form fails within settings.timeout_s seconds
    raise NotImplementedError("the TODO above")
    return settings


if __name__ == "__main__":  # the check is in checks/lab05.py: you need not read it
    from checks import lab05
    lab05.run(Settings=Settings, BadSettings=BadSettings, settings_from_args=settings_from_args,
              init_from_args=init_from_args)
