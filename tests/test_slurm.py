"""template/train_ddp.sbatch on a real Slurm: a one-node cluster (munged, slurmctld, slurmd) started
here in a temporary folder, the sbatch script submitted as practitioners submit it.

Made single-node and CPU-only only by what the script documents: sbatch options on the command
line (--nodes=1 --gpus-per-node=0 --cpus-per-task=1 ...) and its variables (OUT, NPROC_PER_NODE).
An FSDP job meets its real time limit (`--time=4`, the script's defaults: it saves at half the
limit, requeues, resumes); other jobs are stopped by hand with `scancel --signal` without `--batch`
(USR2, INT, USR1) and with a plain `scancel`. Every job that finishes must end with the weights of an
uninterrupted run, bit for bit.

Needs root and Debian's slurm-wlm and munge (`.ci/run` installs them); skipped with the reason
elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launch, split_faults

from tools import slurm_node

pytestmark = pytest.mark.slow(2)  # Slurm jobs with torchrun, stopped and requeued

SBATCH = ROOT / "template" / "train_ddp.sbatch"
SCRIPT = ROOT / "template" / "train_ddp.py"
# Batch 16: 60 steps over an epoch boundary (44 steps an epoch at 2 processes, 89 at 1), slowed with
# --step-delay, a log line every 5 steps: the test sees where training is, and signals it at a log
# line, with seconds of steps to go even when the signal takes long to come (the machine may be loaded).
TRAIN = ["--epochs", "2", "--max-steps", "60", "--batch-size", "16", "--workers", "1", "--log-every", "5",
         "--checkpoint-every", "1000"]
SLOW = ["--step-delay", "0.3"]
# The time-limit job: --time=4 (240 s) saves 120 s in; 16 steps of 8 s each take longer than that.
TIMED = ["--max-steps", "16", "--fsdp"]
DEADLINE = 420  # seconds for a whole job, requeues included; anything longer is a hang
MEANING = r"\([^)]*\)"  # "SIGUSR1 (what it means here): saved ..."


class Cluster(slurm_node.Cluster):
    """The one-node Slurm (tools/slurm_node.py), which submits the template's script."""

    def __init__(self, folder: Path):
        # Each pytest-xdist worker that runs these tests starts a cluster of its own, on one machine; the
        # sbatch derives its rendezvous port from the job id, so the clusters number their jobs apart.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        super().__init__(folder, first_job=1 + 100 * (int(worker) if worker.isdigit() else 0))

    def submit(self, out: Path, nproc: int, *args: str, minutes: int = 10) -> tuple[str, Path]:
        """sbatch the template's script as documented: options and variables only. (job id, its output)"""
        log = out.with_suffix(".out")
        args, faults = split_faults(args)  # (--step-delay: RINGSIDE_TEST_FAULTS, which sbatch passes on)
        done = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", f"--time={minutes}",
             f"--output={log}", f"--chdir={ROOT}", str(SBATCH), *args],
            capture_output=True, text=True, timeout=30,
            env=dict(self.env, OUT=str(out), NPROC_PER_NODE=str(nproc), **faults))
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0], log


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_node.why_not()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as error:
        cluster.stop()
        pytest.skip(f"a one-node Slurm cannot be started here: {error}")
    yield cluster
    cluster.stop()


def wait_in_log(cluster: Cluster, log: Path, pattern: str, after: int = 0, timeout: float = DEADLINE) -> re.Match:
    """The first match of `pattern` in the job's output past character `after`."""
    def found():
        text = log.read_text(errors="replace") if log.exists() else ""
        return re.compile(pattern).search(text, after)
    try:
        return cluster.wait_for(found, timeout, f"{pattern!r} in {log.name}")
    except TimeoutError as error:
        text = log.read_text(errors="replace") if log.exists() else "(no output yet)"
        # the errors first: a traceback's last line is what a truncated report would lose
        errors = "\n".join([line for line in text.splitlines() if re.search(r"\w+Error\b|error:", line)][-8:])
        pytest.fail(f"{error}\nerrors in {log.name}:\n{errors}\n{text[-4000:]}\n{cluster.logs()}")


def ended(cluster: Cluster, job: str, states: tuple[str, ...], timeout: float = DEADLINE) -> dict:
    """The job's scontrol record once it is in one of `states` (a job that requeues passes through others)."""
    return cluster.wait_for(lambda: (lambda j: j if j.get("JobState") in states else None)(cluster.job(job)),
                            timeout, f"job {job} in {'/'.join(states)}")


def result_of(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def step_of(path: str) -> int:
    p = Path(path)
    return torch.load(p / "train_state.pt" if p.is_dir() else p, weights_only=True)["step"]


@pytest.fixture(scope="module")
def timed_job(slurm, tmp_path_factory):
    """Submitted first, so that it runs while the other tests do: 2 FSDP processes at --time=4 with the
    script's defaults, which a real time limit stops; and the uninterrupted run it must end like."""
    folder = tmp_path_factory.mktemp("timed")
    # The first job of this new cluster: another program listens on the rendezvous port that the sbatch
    # derives from its id meanwhile, and the script must take another (a busy port, not a failed job).
    with socket.create_server(("127.0.0.1", 20000 + slurm.first_job)):
        job, log = slurm.submit(folder / "run", 2, *TRAIN, *TIMED, "--step-delay", "8", minutes=4)
        plain = launch(SCRIPT, 2, "--out", str(folder / "plain"), *TRAIN, *TIMED)
        assert plain.returncode == 0, (plain.stdout + plain.stderr)[-3000:]
        yield job, log, folder


@pytest.mark.timeout(1500)  # Slurm jobs with requeues, on a machine that may be loaded
def test_requested_stops_save_and_end_completed_and_usr1_requeues_bit_for_bit(slurm, timed_job, tmp_path):
    """`scancel --signal=USR2 JOB` and `scancel --signal=INT JOB`, without --batch (the signal reaches
    torchrun and the training processes, not the batch script): the training saves, the job ends
    COMPLETED (exit 0), not requeued. `scancel --signal=USR1 JOB` without --batch: saves, the job
    requeues itself and ends with the uninterrupted run's weights, bit for bit. A plain `scancel`:
    CANCELLED, not requeued, and whatever it saved reads."""
    jobs = {name: slurm.submit(tmp_path / name, 1, *TRAIN, *SLOW) for name in ("USR2", "INT", "USR1", "cancel")}
    plain = launch(SCRIPT, 1, "--out", str(tmp_path / "plain"), *TRAIN)  # uninterrupted, meanwhile
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-3000:]
    for name, (job, log) in jobs.items():
        wait_in_log(slurm, log, r"step 5/60")
        if name == "cancel":
            slurm.run("scancel", job)
        else:  # USR1 with --batch: to the batch script, which passes it on (and says where it came from)
            slurm.run("scancel", f"--signal={name}", *(["--batch"] if name == "USR1" else []), job)
    # A job whose start-up (32 s here) eats the window before its time limit (--time=1: it saves at
    # 30 s): the training saves, and the job is not requeued, saying why in one line.
    jobs["short"] = slurm.submit(tmp_path / "short", 1, *TRAIN, *SLOW, "--startup-delay", "32", minutes=1)

    for name in ("USR2", "INT"):
        job, log = jobs[name]
        state = ended(slurm, job, ("COMPLETED", "FAILED", "CANCELLED"))
        text = log.read_text()
        assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, text[-4000:])
        assert state["Restarts"] == "0" and "requeueing" not in text and "saved and stopped as asked" in text, text[-4000:]
        saved = re.search(rf"SIG{name} {MEANING}: saved (\S+) at step (\d+)", text)
        assert saved and step_of(saved.group(1)) == int(saved.group(2)) < 60, text[-4000:]

    job, log = jobs["USR1"]
    assert "SIGUSR1 to the batch script (scancel --signal=USR1 --batch" in log.read_text(), log.read_text()[-4000:]
    saved = wait_in_log(slurm, log, rf"SIGUSR1 {MEANING}: saved (\S+) at step (\d+)")
    wait_in_log(slurm, log, rf"requeueing job {job}", after=saved.end())
    resumed = wait_in_log(slurm, log, r"resumed from (\S+) at step (\d+)", after=saved.end())
    assert resumed.groups() == saved.groups(), log.read_text()[-4000:]
    state = ended(slurm, job, ("COMPLETED", "FAILED"))
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, text[-4000:])
    assert result_of(tmp_path / "USR1")["weights_sha256"] == result_of(tmp_path / "plain")["weights_sha256"], \
        "stopped by SIGUSR1 and requeued: not bit for bit"

    job, log = jobs["short"]
    state = ended(slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    text = log.read_text()
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", (state, text[-4000:])
    assert "time limit near (the timer below): SIGUSR1 to the training" in text, text[-4000:]
    saved = re.search(rf"SIGUSR1 {MEANING}: saved (\S+) at step (\d+)", text)
    assert saved and step_of(saved.group(1)) == int(saved.group(2)), text[-4000:]  # nothing lost
    assert re.search(r"not requeueing: this attempt trained \d+ s \(\d+ steps\) after \d+ s of start-up", text) \
        and "requeueing job" not in text, text[-4000:]

    job, log = jobs["cancel"]
    state = ended(slurm, job, ("CANCELLED",), 60)
    text = log.read_text()
    assert state["Restarts"] == "0" and "requeueing" not in text, text[-4000:]
    for path in (tmp_path / "cancel").glob("checkpoint-*.pt"):
        torch.load(path, weights_only=True)
    for name in jobs:
        assert not list((tmp_path / name).glob(".*.tmp")), name


@pytest.mark.timeout(2400)  # Slurm jobs with requeues, on a machine that may be loaded
def test_an_fsdp_job_at_a_short_time_limit_saves_requeues_and_ends_bit_for_bit(slurm, timed_job):
    """--time=4 with the script's defaults (SAVE_MARGIN=300): the script says that it saves at half the
    limit instead; the real time limit (the script's own timer, not a signal sent by hand) stops the
    training, which saves its shards; the job requeues itself, resumes from that checkpoint, and
    ends COMPLETED with the uninterrupted run's weights, bit for bit."""
    job, log, folder = timed_job
    assert job == str(slurm.first_job), "the timed job must be the new cluster's first: the test holds its port"
    wait_in_log(slurm, log, rf"port {20000 + slurm.first_job} is in use on \S+: using \d+, a free one")
    wait_in_log(slurm, log, r"--time is 240 s, less than twice SAVE_MARGIN=300: saving at half of it, 120 s "
                            r"before the limit")
    saved = wait_in_log(slurm, log, rf"SIGUSR1 {MEANING}: saved (\S+) at step (\d+)")
    text = log.read_text()
    assert "time limit near (the timer below): SIGUSR1 to the training" in text, text[-4000:]
    assert "checkpoint-" in saved.group(1) and not saved.group(1).endswith(".pt") and int(saved.group(2)) < 16
    wait_in_log(slurm, log, rf"requeueing job {job}", after=saved.end())
    resumed = wait_in_log(slurm, log, r"resumed from (\S+) at step (\d+)", after=saved.end())
    assert resumed.groups() == saved.groups(), log.read_text()[-4000:]
    # Unloaded, one requeue: 4 to 5 minutes in all. On a loaded machine each attempt's start-up (torchrun,
    # two processes importing torch) eats most of its 120 s, and it takes several requeues of a step or two.
    state = ended(slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 1800)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and int(state["Restarts"]) >= 1, (state, text[-4000:])
    result = result_of(folder / "run")
    assert result["step"] == 16 and result["world_size"] == 2, result
    assert result["weights_sha256"] == result_of(folder / "plain")["weights_sha256"], \
        "FSDP stopped by the time limit and requeued: not bit for bit"
    assert "forcing job termination" not in text and "DUE TO TIME LIMIT" not in text, text[-4000:]
    assert not list((folder / "run").glob(".*.tmp"))
