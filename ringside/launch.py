"""Starting a script under torchrun from Python (a notebook cell or a test), always with a timeout.

`!torchrun ...` in a notebook ignores a failing exit status, even under nbval, and has no time
limit; `torchrun_script` has both: a failing or hanging lab fails the cell that ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def torchrun_command(script: str | Path, nproc: int = 4, *args: str, all_ranks: bool = False) -> list[str]:
    """The torchrun command line for `script` on `nproc` local ranks, port chosen by torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if not all_ranks:  # lines of several ranks interleave differently on every run
        cmd.append("--local-ranks-filter=0")
    return cmd + [str(script), *map(str, args)]


def quiet_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launched job: one thread per rank, no torchrun warning about it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def torchrun_script(
    script: str | Path,
    nproc: int = 4,
    *args: str,
    timeout: float = 180,
    check: bool = True,
    all_ranks: bool = False,
    env: dict[str, str] | None = None,
    show: bool = True,
) -> subprocess.CompletedProcess:
    """Run `script` under torchrun and print what rank 0 printed.

    check=True raises CalledProcessError when the job fails (its stderr is printed first);
    a job still running after `timeout` seconds is killed and raises TimeoutExpired."""
    result = subprocess.run(
        torchrun_command(script, nproc, *args, all_ranks=all_ranks),
        cwd=ROOT, env=quiet_env(env), capture_output=True, text=True, timeout=timeout,
    )
    if show:
        print(result.stdout, end="")
    if check and result.returncode != 0:
        print(result.stderr[-4000:], file=sys.stderr)
        result.check_returncode()
    return result
