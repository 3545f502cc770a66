"""The check of lab 05 (init_methods): it runs the code of labs/05_init_methods.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, print0, run_lab
from ringside.rendezvous import fork_processes, free_port, fresh_file

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------

# Bad settings: (what is wrong, argv, environment, a phrase the message must contain)
RANKS = ["--rank", "0", "--world-size", "2"]
BAD = [
    ("an unknown scheme (udp://)", ["--init-method", "udp://127.0.0.1:29500", *RANKS], {}, "tcp://"),
    ("tcp:// without a port", ["--init-method", "tcp://127.0.0.1", *RANKS], {}, "port"),
    ("tcp:// with port 70000", ["--init-method", "tcp://127.0.0.1:70000", *RANKS], {}, "port"),
    ("a relative file:// path", ["--init-method", "file://rendezvous", *RANKS], {}, "absolute"),
    # urlparse reads "node1" as a host and /tmp/rdzv as the path: a rendezvous on another machine's disk,
    # which init_process_group would silently take as this machine's /tmp/rdzv
    ("file:// with a host (file://node1/tmp/rdzv)", ["--init-method", "file://node1/tmp/rdzv", *RANKS], {}, "absolute"),
    ("tcp:// with port 0", ["--init-method", "tcp://127.0.0.1:0", *RANKS], {}, "port"),
    ("file:// in a missing folder", ["--init-method", "file:///no/such/folder/rdzv", *RANKS], {}, "/no/such/folder"),
    ("env:// without MASTER_ADDR", [], {"MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ("env:// without MASTER_PORT", [], {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT"),
    ("tcp:// with no rank anywhere", ["--init-method", "tcp://127.0.0.1:29500"], {}, "rank"),
    ("rank 4 in a world of 4", ["--init-method", "tcp://127.0.0.1:29500", "--rank", "4", "--world-size", "4"], {},
     "rank"),
    ("a timeout of 0 s", ["--init-method", "tcp://127.0.0.1:29500", *RANKS, "--timeout", "0"], {}, "timeout"),
    # inputs of the same kinds at another value: an empty (not missing) variable, a negative number
    ("env:// with an empty MASTER_ADDR", [], {"MASTER_ADDR": "", "MASTER_PORT": "29500", "RANK": "0",
                                             "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ("a negative timeout (-5 s)", ["--init-method", "tcp://127.0.0.1:29500", *RANKS, "--timeout", "-5"], {}, "timeout"),
    ("a negative rank", ["--init-method", "tcp://127.0.0.1:29500", "--rank", "-1", "--world-size", "2"], {}, "rank"),
]


def check_bad_settings(checks: Checks) -> None:
    """Every bad setting must raise BadSettings at once, with a message naming the problem."""
    for what, argv, environ, phrase in BAD:
        try:
            settings = lab.settings_from_args(argv, environ)
        except lab.BadSettings as error:
            checks.expect(phrase.lower() in str(error).lower(),
                          f"{what}: the message {str(error)!r} does not mention {phrase!r} - say what to fix")
        except NotImplementedError:
            raise
        except Exception as error:
            checks.fail(f"{what}: raised {type(error).__name__}({error}) - raise BadSettings with a message "
                        f"that says what to fix")
        else:
            # env:// cases pass an environment without a variable that this torchrun process does have
            elsewhere = [k for k in ("MASTER_ADDR", "MASTER_PORT") if "--init-method" not in argv and k not in environ]
            also = (f" (is {' and '.join(elsewhere)} read from the `environ` argument, not os.environ?)"
                    if elsewhere else "")
            checks.fail(f"{what} was accepted as {settings} - settings_from_args must raise BadSettings{also}")


def attempt(argv: list[str], environ: dict[str, str]) -> lab.Settings | str:
    """The learner's settings_from_args on these inputs: the Settings, or what it raised."""
    try:
        return lab.settings_from_args(argv, environ)
    except NotImplementedError:
        raise
    except Exception as error:  # a mistake in the learner's code becomes a diagnosis, not a crash
        return f"{type(error).__name__}: {error}"


def check_good_settings(checks: Checks) -> bool:
    """Where rank and world size come from: the `environ` given (not os.environ), torchrun's RANK
    (not LOCAL_RANK), argv first, and rank 0 is a rank like any other. False if a case raised."""
    here = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    # Node 1 of 2, 8 processes per node: RANK 13 = 1 x 8 + LOCAL_RANK 5 (no rank of this run has them).
    torchrun_env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "13", "LOCAL_RANK": "5",
                    "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    tcp = ["--init-method", "tcp://127.0.0.1:29500"]
    cases = [  # (what, argv, environ, expected (rank, world size), the likely mistakes if not)
        ("env:// with RANK=13, LOCAL_RANK=5, WORLD_SIZE=16", [], torchrun_env, (13, 16), {
            5: "the global rank is RANK; LOCAL_RANK only numbers the processes of one node (it picks the GPU)",
            here[0]: "that is this process's own torchrun rank - read the `environ` argument, not os.environ",
        }),
        ("--rank 2 --world-size 4 with RANK=0, WORLD_SIZE=1 set", [*tcp, "--rank", "2", "--world-size", "4"],
         {"RANK": "0", "WORLD_SIZE": "1"}, (2, 4), {0: "the command line must win over the environment"}),
        ("--rank 0 --world-size 4 with RANK=3, WORLD_SIZE=4 set", [*tcp, "--rank", "0", "--world-size", "4"],
         {"RANK": "3", "WORLD_SIZE": "4"}, (0, 4), {
            3: "--rank 0 was treated as missing - `args.rank or ...` is false for 0; test `args.rank is not None`"}),
        ("--rank 0 --world-size 2 and no environment", [*tcp, "--rank", "0", "--world-size", "2"], {}, (0, 2), {}),
        ("tcp:// at port 65535, the top of the range", ["--init-method", "tcp://127.0.0.1:65535", "--rank", "1",
                                                         "--world-size", "2"], {}, (1, 2), {}),
        ("tcp:// at port 1, the bottom of the range", ["--init-method", "tcp://127.0.0.1:1", "--rank", "1",
                                                       "--world-size", "2"], {}, (1, 2), {}),
    ]
    for what, argv, environ, expected, causes in cases:
        got = attempt(argv, environ)
        if isinstance(got, str):
            hint = ("--rank 0 was treated as missing - `args.rank or ...` is false for 0; test `args.rank is not None`"
                    if "--rank 0" in what else
                    "ports go from 1 to 65535, both included" if "port" in what else
                    "these settings are valid: raise only for the cases in the docstring")
            checks.fail(f"{what} raised {got}: {hint}")
            return False
        found = (got.rank, got.world_size)
        hint = causes.get(got.rank, "take them from --rank/--world-size, else from RANK/WORLD_SIZE in `environ`")
        if got.rank == expected[0] and got.world_size == here[1] != expected[1]:
            hint = "the world size is this process's own WORLD_SIZE - read the `environ` argument, not os.environ"
        checks.expect(found == expected, f"{what} gave rank {got.rank} of {got.world_size}, expected "
                                         f"{expected[0]} of {expected[1]}: {hint}")
    got = attempt(["--init-method", f"file://{fresh_file()}", "--rank", "0", "--world-size", "1"], {})
    checks.expect(not isinstance(got, str) and got.init_method.startswith("file:///"),
                  f"a valid file:// setting came back as {got}")
    return True


def _join_alone(rank: int, n: int, init_from_args) -> str:
    """A world of 2 that only this process joins: it must fail within its 2 s timeout. (The lab's
    function comes as an argument: in a notebook's kernel the process is started afresh.)"""
    init_from_args(["--init-method", f"file://{fresh_file()}", "--rank", "0", "--world-size", "2",
                    "--timeout", "2"])
    return "joined"


def check_fails_fast(checks: Checks) -> None:
    """A wrong world size (a rank that never comes) must end in an error, not a 30-minute hang."""
    limit = 20  # the 2 s timeout plus starting the group on a busy machine; a hang is killed here
    outcome = fork_processes(_join_alone, 1, lab.init_from_args, timeout=limit)[0]
    if outcome.detail.startswith("NotImplementedError: "):
        raise NotImplementedError(outcome.detail.split(": ", 1)[1])
    checks.expect(outcome.status != "killed",
                  f"init_from_args with a world size of 2 and one process still waited after {limit} s: "
                  f"pass timeout=timedelta(seconds=settings.timeout_s) to dist.init_process_group "
                  f"(its default is 30 minutes)")
    checks.expect(outcome.status != "ok",
                  "init_from_args returned for a world of 2 that only one process joined")
    # It must fail by timing out (gloo says "Wait timeout"), not by any error that comes at once.
    timed_out = "timed out" in outcome.detail.lower() or "wait timeout" in outcome.detail.lower()
    missing = next((word for word in ("rank", "world_size", "world size")
                    if f"{word} parameter missing" in outcome.detail.lower()), None)
    if outcome.status == "error" and missing:
        checks.fail(f"init_from_args failed at once: torch says '{missing} parameter missing' - tcp:// and "
                    f"file:// take the rank and the world size as arguments (only env:// reads them from the "
                    f"environment): pass rank=settings.rank and world_size=settings.world_size")
        return
    checks.expect(outcome.status != "error" or timed_out,
                  f"init_from_args failed with {outcome.detail[:200]!r} instead of timing out: the group must "
                  f"wait settings.timeout_s seconds for the missing rank, then fail - call "
                  f"dist.init_process_group with timeout=timedelta(seconds=settings.timeout_s)")


def check_group(checks: Checks, method: str, settings: lab.Settings) -> None:
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
    if not check_good_settings(checks):  # first: a mistake here explains many bad-settings failures
        return
    check_bad_settings(checks)
    if checks.failures:  # (the same on every rank: the cases are) fix these first; forming groups waits seconds
        return
    check_fails_fast(checks)

    # 1. env://: torchrun's MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
    settings = lab.init_from_args([])
    check_group(checks, "env://", settings)
    print0(f"env://  formed a group of {settings.world_size}")

    # rank 0 chooses a free port and a fresh file for the next two groups and tells the others
    where = [free_port(), fresh_file()] if settings.rank == 0 else [None, None]
    dist.broadcast_object_list(where, src=0)
    port, path = where
    dist.destroy_process_group()
    ranks = ["--rank", os.environ["RANK"], "--world-size", os.environ["WORLD_SIZE"]]
    # torchrun sets TORCHELASTIC_USE_AGENT_STORE=True for env://: its agent already serves the store at
    # MASTER_ADDR:MASTER_PORT. torch 2.11 applies it to a tcp:// address too, and makes every rank a
    # client of a store that nobody serves (torch/distributed/rendezvous.py, _create_c10d_store), so
    # the group times out; torch 2.14 applies it only to the agent's own address (_agent_store_serves).
    # The variable belongs to env://: the tcp:// and file:// groups below are formed without it.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)

    # 2. tcp://: rank 0 starts a TCPStore on the port, the others connect to it
    settings = lab.init_from_args(["--init-method", f"tcp://127.0.0.1:{port}", *ranks])
    check_group(checks, "tcp://", settings)
    print0(f"tcp:// formed a group of {settings.world_size}")
    dist.destroy_process_group()

    # 3. file://: every rank opens the same file on a shared file system (here: one machine)
    settings = lab.init_from_args(["--init-method", f"file://{path}", *ranks])
    check_group(checks, "file://", settings)
    print0(f"file:// formed a group of {settings.world_size}")


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 05 (init_methods)", init=False)
