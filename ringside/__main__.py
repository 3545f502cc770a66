"""`python -m ringside NPROC SCRIPT [ARGS...]`: what `make lab` and `make solution` run.

torchrun on NPROC local ranks, for a person at a terminal: every rank's output as it comes, and
the lab's verdict as the last thing on screen (run_for_learner)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

from .launch import quiet_env, torchrun_command


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


def own_clone_env(script: str) -> dict[str, str]:
    """The job's environment, with the script's own clone first on the ranks' path (REVIEW D.8): a
    .venv shared by several clones has `checks` and `ringside` installed from whichever clone ran
    `make setup` last, and a lab would silently import that clone's check."""
    root = Path(script).resolve().parent.parent
    if not (root / "checks").is_dir():
        return quiet_env()
    return quiet_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})


def run_for_learner(script: str, nproc: int, *args: str) -> int:
    """Run a lab under torchrun for a person at a terminal, every rank's output as it comes, so
    that a lab's verdict is the last thing on screen: torchrun's own ChildFailedError traceback and
    SIGTERM warnings after a lab that reported (55 lines that make a clear verdict look like a
    crash) are dropped, and so are they after a lab's one-line refusal of the world size. A lab that
    crashed before it could report keeps them."""
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
    sys.exit(run_for_learner(sys.argv[2], int(sys.argv[1]), *sys.argv[3:]))
