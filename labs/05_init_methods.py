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

import torch
import torch.distributed as dist

from ringside import Checks, print0, run_lab
from ringside.rendezvous import fork_processes, free_port, fresh_file


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
    # TODO: check the form of the init method (tcp://HOST:PORT, file:///absolute/path, env:// with MASTER_ADDR and MASTER_PORT set), take rank and world size from argv or else RANK and WORLD_SIZE, check their range, and raise BadSettings saying what to fix
    raise NotImplementedError("the TODO above")


def init_from_args(argv: list[str], environ: Mapping[str, str] = os.environ) -> Settings:
    """Join the default process group (gloo) as the settings say, and return them.
    A group that cannot form must fail within settings.timeout_s seconds, never hang."""
    settings = settings_from_args(argv, environ)
    # TODO: call dist.init_process_group("gloo", ...) with the init method, rank, world size and a timeout of settings.timeout_s seconds
    raise NotImplementedError("the TODO above")
    return settings


# ---------------------------------------------------------------------------- the checks

# Bad settings: (what is wrong, argv, environment, a phrase the message must contain)
RANKS = ["--rank", "0", "--world-size", "2"]
BAD = [
    ("an unknown scheme (udp://)", ["--init-method", "udp://127.0.0.1:29500", *RANKS], {}, "tcp://"),
    ("tcp:// without a port", ["--init-method", "tcp://127.0.0.1", *RANKS], {}, "port"),
    ("tcp:// with port 70000", ["--init-method", "tcp://127.0.0.1:70000", *RANKS], {}, "port"),
    ("a relative file:// path", ["--init-method", "file://rendezvous", *RANKS], {}, "absolute"),
    ("file:// in a missing folder", ["--init-method", "file:///no/such/folder/rdzv", *RANKS], {}, "/no/such/folder"),
    ("env:// without MASTER_ADDR", [], {"MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ("env:// without MASTER_PORT", [], {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT"),
    ("tcp:// with no rank anywhere", ["--init-method", "tcp://127.0.0.1:29500"], {}, "rank"),
    ("rank 4 in a world of 4", ["--init-method", "tcp://127.0.0.1:29500", "--rank", "4", "--world-size", "4"], {},
     "rank"),
    ("a timeout of 0 s", ["--init-method", "tcp://127.0.0.1:29500", *RANKS, "--timeout", "0"], {}, "timeout"),
]


def check_bad_settings(checks: Checks) -> None:
    """Every bad setting must raise BadSettings at once, with a message naming the problem."""
    for what, argv, environ, phrase in BAD:
        try:
            settings = settings_from_args(argv, environ)
        except BadSettings as error:
            checks.expect(phrase.lower() in str(error).lower(),
                          f"{what}: the message {str(error)!r} does not mention {phrase!r} - say what to fix")
        except NotImplementedError:
            raise
        except Exception as error:
            checks.fail(f"{what}: raised {type(error).__name__}({error}) - raise BadSettings with a message "
                        f"that says what to fix")
        else:
            checks.fail(f"{what} was accepted as {settings} - settings_from_args must raise BadSettings")


def check_good_settings(checks: Checks) -> None:
    """Where rank and world size come from: torchrun's RANK (not LOCAL_RANK), and argv first."""
    torchrun_env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "5", "LOCAL_RANK": "1",
                    "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    got = settings_from_args([], torchrun_env)
    checks.expect((got.rank, got.world_size) == (5, 8),
                  f"env:// with RANK=5, LOCAL_RANK=1, WORLD_SIZE=8 gave rank {got.rank} of {got.world_size}: "
                  f"the global rank is RANK; LOCAL_RANK only numbers the processes of one node (it picks the GPU)")
    got = settings_from_args(["--init-method", "tcp://127.0.0.1:29500", "--rank", "2", "--world-size", "4"],
                             {"RANK": "0", "WORLD_SIZE": "1"})
    checks.expect((got.rank, got.world_size) == (2, 4),
                  f"--rank 2 --world-size 4 with RANK=0, WORLD_SIZE=1 set gave rank {got.rank} of {got.world_size}: "
                  f"the command line must win over the environment")
    got = settings_from_args(["--init-method", f"file://{fresh_file()}", "--rank", "0", "--world-size", "1"], {})
    checks.expect(got.init_method.startswith("file:///"), f"a valid file:// setting came back as {got}")


def _join_alone(rank: int, n: int) -> str:
    """A world of 2 that only this process joins: it must fail within its 2 s timeout."""
    init_from_args(["--init-method", f"file://{fresh_file()}", "--rank", "0", "--world-size", "2",
                    "--timeout", "2"])
    return "joined"


def check_fails_fast(checks: Checks) -> None:
    """A wrong world size (a rank that never comes) must end in an error, not a 30-minute hang."""
    limit = 20  # the 2 s timeout plus starting the group on a busy machine; a hang is killed here
    outcome = fork_processes(_join_alone, 1, timeout=limit)[0]
    if outcome.detail.startswith("NotImplementedError: "):
        raise NotImplementedError(outcome.detail.split(": ", 1)[1])
    checks.expect(outcome.status != "killed",
                  f"init_from_args with a world size of 2 and one process still waited after {limit} s: "
                  f"pass timeout=timedelta(seconds=settings.timeout_s) to dist.init_process_group "
                  f"(its default is 30 minutes)")
    checks.expect(outcome.status != "ok",
                  "init_from_args returned for a world of 2 that only one process joined")


def check_group(checks: Checks, method: str, settings: Settings) -> None:
    """The group exists, this process has its torchrun rank in it, and a collective works."""
    expected_rank, expected_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ok = dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (expected_rank, expected_size)
    checks.expect(ok, f"{method}: after init_from_args this process is not rank {expected_rank} of "
                      f"{expected_size} in the default group - did init_process_group get rank and world size?")
    if not ok:
        return
    total = torch.tensor([settings.rank])
    dist.all_reduce(total)
    expected = expected_size * (expected_size - 1) // 2
    checks.expect(total.item() == expected, f"{method}: the sum of ranks is {total.item()}, not {expected}")


def main(checks: Checks) -> None:
    check_bad_settings(checks)
    check_good_settings(checks)
    check_fails_fast(checks)

    # 1. env://: torchrun's MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
    settings = init_from_args([])
    check_group(checks, "env://", settings)
    print0(f"env://  formed a group of {settings.world_size}")

    # rank 0 chooses a free port and a fresh file for the next two groups and tells the others
    where = [free_port(), fresh_file()] if settings.rank == 0 else [None, None]
    dist.broadcast_object_list(where, src=0)
    port, path = where
    dist.destroy_process_group()
    ranks = ["--rank", os.environ["RANK"], "--world-size", os.environ["WORLD_SIZE"]]

    # 2. tcp://: rank 0 starts a TCPStore on the port, the others connect to it
    settings = init_from_args(["--init-method", f"tcp://127.0.0.1:{port}", *ranks])
    check_group(checks, "tcp://", settings)
    print0(f"tcp:// formed a group of {settings.world_size}")
    dist.destroy_process_group()

    # 3. file://: every rank opens the same file on a shared file system (here: one machine)
    settings = init_from_args(["--init-method", f"file://{path}", *ranks])
    check_group(checks, "file://", settings)
    print0(f"file:// formed a group of {settings.world_size}")


if __name__ == "__main__":
    run_lab(main, title="Lab 05 (init_methods)", init=False)
