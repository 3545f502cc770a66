"""`python -m ringside NPROC SCRIPT [ARGS...]`: what `make lab` and `make solution` run.

The script runs on NPROC ranks exactly as `torchrun --standalone --nproc-per-node NPROC SCRIPT` would
run it (the same variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...; exit status 0 only when
every rank exits 0), but the ranks are forked from this one process after it imported torch once.
torchrun starts NPROC + 1 fresh Pythons that each import torch (2 s of CPU apiece, 4 s once DDP
imports torch._dynamo): at 4 ranks on a laptop's 2 cores that was half of the wait for a verdict,
and a learner runs a lab ten or twenty times. Every rank's output shows as it comes.

RINGSIDE_LAUNCH=torchrun runs the real torchrun instead (what a cluster runs; its own log lines
and failure report are filtered out, so that the lab's verdict is the last thing on screen)."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .launch import PREIMPORTS, _wait_pids, fork_script_ranks, preimport, quiet_env, reserved_port, torchrun_command

# A lab's checks bound every collective; this only ends a job that hangs outside them.
TIMEOUT = float(os.environ.get("RINGSIDE_TIMEOUT", 900))


def own_clone_env(script: str) -> dict[str, str]:
    """The job's environment, with the script's own clone first on the ranks' path (REVIEW D.8): a
    .venv shared by several clones has `checks` and `ringside` installed from whichever clone ran
    `make setup` last, and a lab would silently import that clone's check."""
    root = Path(script).resolve().parent.parent
    if not (root / "checks").is_dir():
        return quiet_env()
    return quiet_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})


def run_forked(script: str, nproc: int, *args: str, timeout: float = TIMEOUT) -> int:
    """The ranks forked from this process (see the module's docstring); torchrun's exit status."""
    env = own_clone_env(script)
    # A rank's path as under torchrun: the script's folder (set in the rank), then PYTHONPATH's clone
    sys.path[1:1] = env.get("PYTHONPATH", "").split(os.pathsep)[:1]
    preimport(*(name for name in PREIMPORTS if name != "torch._dynamo" or _builds_ddp(script)))
    with reserved_port() as port:
        pids = fork_script_ranks(script, nproc, args, env, {}, os.getcwd(), port)
    try:
        codes = _wait_pids(pids, timeout)
    except KeyboardInterrupt:  # Ctrl-C reached every rank too (one process group): end them
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return 130
    if None in codes:
        print(f"{script}: ranks still running after {timeout:g} s (a hang?) were killed", file=sys.stderr)
    return 0 if all(code == 0 for code in codes) else 1


def _builds_ddp(script: str) -> bool:
    """Whether the lab or its check builds DDP or FSDP or steps a torch.optim optimizer, whose first use
    imports torch._dynamo (2 s of CPU; an optimizer's first step() 1.2 s): then it is imported once here
    rather than in every rank. A guess from the source: a wrong one costs time, never a result (a rank
    imports what it needs)."""
    path = Path(script)
    check = path.resolve().parent.parent / "checks" / f"lab{path.name[:2]}.py"
    texts = [path.read_text()] + ([check.read_text()] if check.exists() else [])
    return any(word in text for text in texts for word in ("DistributedDataParallel", "fully_shard", "torch.optim."))


def _agent_noise(line: str) -> bool:
    """torchrun's own log lines ("W1123 05:12:07.03 1234 torch/distributed/elastic/...] ...")."""
    return len(line) > 6 and line[0] in "EWI" and line[1:5].isdigit() and "torch/distributed/elastic" in line


def _filter_stderr(stream, held: list[str], refused: list[str]) -> None:
    """Pass a job's stderr through, minus torchrun's log lines; torchrun's own traceback (its
    ChildFailedError, always the last thing it prints) goes to `held` instead, and a lab's refusal of
    this world size ("... cannot check 1 rank: ...") is also noted in `refused`."""
    block: list[str] = []
    for line in stream:
        if " cannot check " in line:
            refused.append(line)
        if held:  # past torchrun's traceback: the rest is its failure table
            held.append(line)
        elif block:
            block.append(line)
            if not line.startswith((" ", "\t")):  # the exception line ends a traceback
                if any("torch/distributed/run.py" in b or "bin/torchrun" in b for b in block):
                    held.extend(block)
                else:
                    sys.stderr.write("".join(block))  # a rank's own traceback: show it
                block = []
        elif line.startswith("Traceback (most recent call last):"):
            block.append(line)
        elif not _agent_noise(line):
            sys.stderr.write(line)
    sys.stderr.write("".join(block))


def run_under_torchrun(script: str, nproc: int, *args: str) -> int:
    """The real torchrun, every rank's output as it comes, so that a lab's verdict is the last thing
    on screen: torchrun's own ChildFailedError traceback and SIGTERM warnings after a lab that
    reported (55 lines that make a clear verdict look like a crash) are dropped, and so are they
    after a lab's one-line refusal of the world size. A lab that crashed before it could report
    keeps them."""
    proc = subprocess.Popen(torchrun_command(script, nproc, *args, all_ranks=True), env=own_clone_env(script),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    held: list[str] = []
    refused: list[str] = []
    errors = threading.Thread(target=_filter_stderr, args=(proc.stderr, held, refused))
    errors.start()
    reported = False
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        reported = reported or line.rstrip().endswith(("PASS.", "PASSES.", "and run again."))
    code = proc.wait()
    errors.join()
    if not reported and not refused:  # a refusal is one line: it needs no failure report under it
        sys.stderr.write("".join(held))
    return code


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m ringside NPROC SCRIPT [ARGS...]   (or: make lab CH=04 NPROC=4)")
    run = run_under_torchrun if os.environ.get("RINGSIDE_LAUNCH") == "torchrun" else run_forked
    sys.exit(run(sys.argv[2], int(sys.argv[1]), *sys.argv[3:]))
