"""template/train_ddp.sbatch on a real Slurm: a one-node cluster (munged, slurmctld, slurmd) started
here in a temporary folder, the sbatch script submitted as practitioners submit it.

Made single-node and CPU-only only by what the script documents: sbatch options on the command
line (--nodes=1 --gpus-per-node=0 --cpus-per-task=1 ...) and its variables (OUT, NPROC_PER_NODE).
The time-limit signal is what `#SBATCH --signal=B:USR1@300` makes Slurm send, SIGUSR1 to the batch
script, sent at once with `scancel --batch --signal=USR1` (a real time limit is checked by slurmctld
about every 30 s, at minute granularity).

Needs root and Debian's slurm-wlm and munge (`.ci/run` installs them); skipped with the reason
elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launch

pytestmark = pytest.mark.slow(2)  # Slurm jobs with torchrun, stopped and requeued

SBATCH = ROOT / "template" / "train_ddp.sbatch"
SCRIPT = ROOT / "template" / "train_ddp.py"
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "scancel", "scontrol", "squeue", "sinfo")
# 2 processes x batch 16: 44 steps in an epoch; 60 steps, slowed to about 0.1 s each, with a log
# line every 5 steps: the test sees where training is, and signals it at the first log line of each
# attempt, with seconds of steps to go even when the signal takes long to come.
TRAIN = ["--epochs", "2", "--max-steps", "60", "--batch-size", "16", "--workers", "1", "--log-every", "5",
         "--checkpoint-every", "1000"]
SLOW = ["--step-delay", "0.1"]
DEADLINE = 150  # seconds for a whole job, requeues included; anything longer is a hang


def why_not() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if not sys.platform.startswith("linux"):
        return "Slurm runs on Linux"
    if os.geteuid() != 0:
        return "needs root (slurmd runs the jobs as root here)"
    missing = [name for name in (*DAEMONS, *CLIENTS) if not shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin")]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"this machine's name {socket.gethostname()!r} does not resolve (the rendezvous address)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A one-node Slurm in `folder`: its own munge key and socket, ports, state and logs."""

    def __init__(self, folder: Path):
        self.dir = folder
        self.node = socket.gethostname()
        self.env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"), OMP_NUM_THREADS="1",
                        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}:/usr/sbin")
        for name in list(self.env):  # a Slurm job's own variables would confuse the clients
            if name.startswith("SLURM_") and name != "SLURM_CONF":
                del self.env[name]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        d = self.dir
        (d / "state").mkdir()
        (d / "spool").mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.daemon(["munged", "-F", "-f", f"--socket={d}/munge.socket", f"--key-file={key}",
                     f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
                    "munged")
        self.wait_for(lambda: (d / "munge.socket").exists(), 10, "munged did not start")
        # This node as slurmd sees it (its real CPUs), shared by up to 4 jobs.
        probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, env=self.env)
        cpus = re.search(r"CPUs=(\d+)", probe.stdout)
        (d / "slurm.conf").write_text(f"""\
ClusterName=ringside
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again after this many seconds (default 120; 5 is the
# least Slurm accepts, and it ignores a smaller one)
AuthInfo=socket={d}/munge.socket,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus.group(1) if cpus else 1} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        self.daemon(["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")], "slurmctld")
        self.daemon(["slurmd", "-D", "-f", str(d / "slurm.conf"), "-N", self.node], "slurmd")
        self.wait_for(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", 30,
                      "the node did not come up")

    def daemon(self, command: list[str], name: str) -> None:
        out = open(self.dir / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        out.close()

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(self.dir.glob("*.log")))

    def wait_for(self, ready, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what}: {proc.args[0]} exited with {proc.returncode}\n{self.logs()}")
            time.sleep(0.2)
        raise TimeoutError(f"{what} within {timeout} s")

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, env=self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
        return done

    def submit(self, out: Path, nproc: int, *args: str) -> tuple[str, Path]:
        """sbatch the template's script as documented: options and variables only. (job id, its output)"""
        log = out.with_suffix(".out")
        done = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
             f"--output={log}", f"--chdir={ROOT}", str(SBATCH), *args],
            capture_output=True, text=True, timeout=30, env=dict(self.env, OUT=str(out), NPROC_PER_NODE=str(nproc)))
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0], log

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def stop(self) -> None:
        if (self.dir / "slurm.conf").exists():
            self.run("scancel", "--full", "--user=root", check=False)
            try:
                self.wait_for(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 40, "jobs end")
            except (RuntimeError, TimeoutError):
                pass
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = why_not()
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
        pytest.fail(f"{error}\n{text[-4000:]}\n{cluster.logs()}")


def test_sbatch_saves_requeues_and_resumes_bit_for_bit_and_scancel_does_not_requeue(slurm, tmp_path):
    """The time-limit signal (SIGUSR1 to the batch script) mid-run: the training saves, the job
    requeues itself, the requeued job resumes from that checkpoint; a second time-limit signal in
    the requeued run does the same; the third run ends with the weights of an uninterrupted run,
    bit for bit. Two other jobs at the same time: a plain scancel ends one without a requeue, and
    SIGUSR2 (the script's "save and stop") makes the other save and end without a requeue."""
    job, log = slurm.submit(tmp_path / "run", 2, *TRAIN, *SLOW)
    cancelled, cancelled_log = slurm.submit(tmp_path / "cancelled", 1, *TRAIN, *SLOW)
    stopped, stopped_log = slurm.submit(tmp_path / "stopped", 1, *TRAIN, *SLOW)
    plain = launch(SCRIPT, 2, "--out", str(tmp_path / "plain"), *TRAIN)  # uninterrupted, meanwhile
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-3000:]

    wait_in_log(slurm, cancelled_log, r"step 5/60")
    slurm.run("scancel", cancelled)
    wait_in_log(slurm, stopped_log, r"step 5/60")
    slurm.run("scancel", "--batch", "--signal=USR2", stopped)

    stops = []
    for attempt in range(2):  # the time limit twice: in the first run, and in the requeued one
        start = wait_in_log(slurm, log, rf"job {job} \(restart {attempt}\)").end()
        wait_in_log(slurm, log, r"step \d+/60", after=start)  # training: its first log line
        slurm.run("scancel", "--batch", "--signal=USR1", job)
        saved = wait_in_log(slurm, log, r"SIGTERM: saved (\S+) at step (\d+)", after=start)
        stops.append((saved.group(1), int(saved.group(2))))
        wait_in_log(slurm, log, rf"requeueing job {job}", after=saved.end())
        resumed = wait_in_log(slurm, log, r"resumed from (\S+) at step (\d+)", after=saved.end())
        assert (resumed.group(1), int(resumed.group(2))) == stops[-1], log.read_text()[-4000:]
        assert torch.load(stops[-1][0], weights_only=True)["step"] == stops[-1][1]
    wait_in_log(slurm, log, r"training ended with status 0")
    state = slurm.wait_for(lambda: (lambda j: j if j.get("JobState") == "COMPLETED" else None)(slurm.job(job)),
                           30, f"job {job} completed")
    text = log.read_text()
    assert state["Restarts"] == "2" and text.count("requeueing job") == 2, text[-4000:]
    assert stops[0][1] < stops[1][1] < 60, stops
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    expected = json.loads((tmp_path / "plain" / "result.json").read_text())
    assert result["step"] == 60 and result["world_size"] == 2, result
    assert result["weights_sha256"] == expected["weights_sha256"], "stopped twice by Slurm and requeued: not bit for bit"
    assert "forcing job termination" not in text, text[-4000:]  # srun never turned a SIGTERM into SIGKILL
    assert not list((tmp_path / "run").glob(".*.tmp"))

    # The plain scancel: the job is over, not requeued, and what it saved is readable.
    state = slurm.wait_for(lambda: (lambda j: j if j.get("JobState") == "CANCELLED" else None)(slurm.job(cancelled)),
                           30, f"job {cancelled} cancelled")
    text = cancelled_log.read_text()
    assert state["Restarts"] == "0" and "requeueing" not in text, text[-4000:]
    for path in (tmp_path / "cancelled").glob("checkpoint-*.pt"):
        torch.load(path, weights_only=True)
    assert not list((tmp_path / "cancelled").glob(".*.tmp"))

    # SIGUSR2: saved, stopped, not requeued.
    state = slurm.wait_for(lambda: (lambda j: j if j.get("JobState") in ("COMPLETED", "FAILED") else None)(
        slurm.job(stopped)), 60, f"job {stopped} ended")
    text = stopped_log.read_text()
    assert state["Restarts"] == "0" and "requeueing" not in text and "asked to stop" in text, text[-4000:]
    saved = re.search(r"SIGTERM: saved (\S+) at step (\d+)", text)
    assert saved and torch.load(saved.group(1), weights_only=True)["step"] == int(saved.group(2)) < 60, text[-4000:]
