"""A one-node Slurm on this machine (munged, slurmctld, slurmd from Debian's slurm-wlm and munge),
in a folder of its own: its own munge key and socket, ports, state and logs. tests/test_slurm.py
submits the template's sbatch script to it; `make hub-test HUB_SPAWNER=slurm` spawns the room's
learners on it (batchspawner's SlurmSpawner); `make slurm-node` starts one to try `make hub
SPAWNER=slurm` by hand.

    python -m tools.slurm_node up [DIR]      (root) start it; prints the SLURM_CONF to export
    python -m tools.slurm_node down [DIR]    stop it (its jobs cancelled) and remove DIR

`cgroups=True` makes Slurm bound each job itself, as a cluster does (task/cgroup, proctrack/cgroup
on cgroup v1: --mem is the job's memory limit, --cpus-per-task its cores); the template's tests run
without it, as before.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "scancel", "scontrol", "squeue", "sinfo")
DEFAULT_DIR = Path("/srv/ringside-slurm")


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
    """A one-node Slurm in `folder`. `first_job`: its first job id (clusters started side by side
    number their jobs apart); `share`: how many jobs may share a CPU (OverSubscribe=FORCE:share)."""

    def __init__(self, folder: Path, first_job: int = 1, share: int = 4, cgroups: bool = False):
        self.dir = folder
        self.node = socket.gethostname()
        self.first_job, self.share, self.cgroups = first_job, share, cgroups
        self.env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"), OMP_NUM_THREADS="1",
                        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}:/usr/sbin")
        for name in list(self.env):  # a Slurm job's own variables would confuse the clients
            if name.startswith("SLURM_") and name != "SLURM_CONF":
                del self.env[name]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        (d / "state").mkdir()
        (d / "spool").mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.daemon(["munged", "-F", "-f", f"--socket={d}/munge.socket", f"--key-file={key}",
                     f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
                    "munged")
        self.wait_for(lambda: (d / "munge.socket").exists(), 10, "munged did not start")
        (d / "slurm.conf").write_text(self.slurm_conf())
        if self.cgroups:
            (d / "cgroup.conf").write_text(CGROUP_CONF)
        self.daemon(["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")], "slurmctld")
        self.daemon(["slurmd", "-D", "-f", str(d / "slurm.conf"), "-N", self.node], "slurmd")
        self.wait_for(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", 30,
                      "the node did not come up")

    def slurm_conf(self) -> str:
        """This node as slurmd sees it (its real CPUs and memory), shared by up to `share` jobs a CPU."""
        probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, env=self.env).stdout
        cpus = re.search(r"CPUs=(\d+)", probe)
        memory = re.search(r"RealMemory=(\d+)", probe)
        d = self.dir
        if self.cgroups:  # Slurm bounds each job in cgroups of its own: --mem (a consumable), --cpus-per-task
            tracking = "ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup\nSelectTypeParameters=CR_CPU_Memory"
        else:
            tracking = "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectTypeParameters=CR_CPU"
        return f"""\
ClusterName=ringside
FirstJobId={self.first_job}
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
{tracking}
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus.group(1) if cpus else 1} RealMemory={memory.group(1) if memory else 1} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:{self.share}
"""

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

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def stop(self) -> None:
        """Cancel every job, then stop the daemons: those this object started, or (another process
        started them: `up`, then `down`) those its pid files name."""
        if (self.dir / "slurm.conf").exists():
            self.run("scancel", "--full", "--user=root", check=False)
            self.run("scancel", "--full", check=False)
            try:
                self.wait_for(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 40, "jobs end")
            except (RuntimeError, TimeoutError, subprocess.SubprocessError):
                pass
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not self.procs:
            for name in ("slurmd", "slurmctld", "munged"):
                stop_pid_file(self.dir / f"{name}.pid")
        if self.cgroups:
            remove_slurm_cgroups(self.node)


def remove_slurm_cgroups(node: str) -> None:
    """The cgroups task/cgroup made (slurm_<node> in each controller), which slurmd leaves behind:
    empty once the jobs are gone, and removed deepest first."""
    for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{node}"):
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            try:
                folder.rmdir()
            except OSError:
                pass


def stop_pid_file(path: Path) -> None:
    try:
        pid = int(path.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


# Slurm's cgroup v1 plugin, as this machine mounts cgroups (v1 controllers under /sys/fs/cgroup):
# memory bounded by --mem (no swap to spill into), cores by --cpus-per-task.
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainRAMSpace=yes
ConstrainSwapSpace=yes
ConstrainCores=yes
"""


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in ("up", "down"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    folder = Path(argv[1]) if len(argv) == 2 else DEFAULT_DIR
    cluster = Cluster(folder, cgroups=True, share=8)
    if argv[0] == "down":
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
        print(f"slurm node down: {folder} removed")
        return 0
    reason = why_not()
    if reason:
        print(f"slurm node: {reason}", file=sys.stderr)
        return 1
    if folder.exists():
        print(f"slurm node: {folder} exists (a node is up?): `make slurm-down` first", file=sys.stderr)
        return 1
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, OSError) as error:
        cluster.stop()
        print(f"slurm node: did not start: {error}", file=sys.stderr)
        return 1
    folder.chmod(0o755)  # the learners' jobs read slurm.conf (the key stays root's)
    print(f"slurm node up: partition test on {cluster.node}; export SLURM_CONF={folder / 'slurm.conf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
