"""A workshop room on one server: JupyterHub for a list of learners, each bounded in CPU and memory.

    python -m tools.hub up [--learners "ada bob"] [--password PW] [--port 8000]   (make hub)
    python -m tools.hub down                                                      (make hub-down)
    python -m tools.hub room [--watch 2]                   (make room: the instructor's live table)

`up` (root) makes, under HUB_DIR (default /srv/ringside-hub):
  course/    a read-only clone of this checkout at its HEAD: what every learner starts from;
  progress/  the drop folder of lab verdicts (learners may add their own file, not list or read others);
  state/     the hub's database, cookie secret, password, logs and pid files (root only);
  proxy/     configurable-http-proxy from npm, pinned (CHP_VERSION).
It creates one Linux user per learner (comment "ringside learner", home 700), and starts JupyterHub
on 127.0.0.1 with hub/jupyterhub_config.py: a shared workshop password, each learner's server
spawned as that user in cgroups of their own (CPU quota, memory limit, process count), with the
course's .venv as the kernel, OMP_NUM_THREADS=1, and a clone of course/ in ~/ringside made at the
first login. `down` stops the hub and every learner process, removes the learners it created, their
cgroups and HUB_DIR: nothing is left behind.

`up --spawner slurm` (make hub SPAWNER=slurm) spawns each learner's server as a Slurm job of that
learner instead (batchspawner's SlurmSpawner, on the cluster that sbatch reaches: SLURM_CONF), which
Slurm bounds (--cpus-per-task, --mem) in place of the cgroups above; `down` cancels their jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUB_DIR = Path(os.environ.get("HUB_DIR", "/srv/ringside-hub"))
CHP_VERSION = "5.3.0"                     # configurable-http-proxy, from npm
MARK = "ringside learner"                 # the comment of every user `up` creates; `down` removes only those
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_NAME = "ringside-hub"              # each learner: <controller>/ringside-hub/<login>
CONTROLLERS = ("cpu", "memory", "pids")
DEFAULT_LEARNERS = "learner1 learner2 learner3 learner4"
# Each learner's bound (hub/jupyterhub_config.py reads them from the state file). Memory: a learner
# running chapter 00 and then lab 00 peaked at 1.1-1.25 GB (make hub-test, runs/hub/room.txt), with the
# notebook's ranks forked; 2 GB leaves room for chapters with bigger models. A bound, not a reservation
# (except on Slurm, where --mem is reserved on the node).
LIMITS = {"cpus": 1.0, "memory_gb": 2.0, "pids": 1024}


class HubError(Exception):
    pass


def state_file() -> Path:
    return HUB_DIR / "state" / "hub.json"


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the hub needs root (it creates the learners' users and cgroups): sudo make hub"
    for tool in ("useradd", "userdel", "git", "npm"):
        if shutil.which(tool) is None:
            return f"the hub needs {tool}, which this machine lacks"
    if not (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").exists():
        return "the hub bounds each learner with cgroups, and /sys/fs/cgroup has none"
    return None


def _run(*cmd: str, **kwargs) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise HubError(f"{' '.join(cmd)}: {(result.stderr or result.stdout).strip()[-500:]}")
    return result.stdout


def ours(login: str) -> bool:
    try:
        return pwd.getpwnam(login).pw_gecos.split(",")[0] == MARK
    except KeyError:
        return False


def create_learners(logins: list[str]) -> None:
    for login in logins:
        try:
            pwd.getpwnam(login)
        except KeyError:
            _run("useradd", "--create-home", "--shell", "/bin/bash", "--comment", MARK, login)
            os.chmod(pwd.getpwnam(login).pw_dir, 0o700)  # no learner reads another's files
            continue
        if not ours(login):
            raise HubError(f"a user {login} exists already and is not a ringside learner: choose other names")


def cgroup_dirs(login: str) -> list[Path]:
    """The learner's cgroup in each controller (cgroup v1, as on this machine), or the v2 one."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT / CGROUP_NAME / login]
    return [CGROUP_ROOT / c / CGROUP_NAME / login for c in CONTROLLERS if (CGROUP_ROOT / c).is_dir()]


def make_cgroups(login: str, limits: dict) -> list[Path]:
    """The learner's cgroups with their limits: what one runaway lab can take from the room."""
    memory = int(limits["memory_gb"] * 2**30)
    quota = int(limits["cpus"] * 100_000)
    dirs = cgroup_dirs(login)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        values = {"memory.limit_in_bytes": memory, "memory.max": memory, "cpu.cfs_period_us": 100_000,
                  "cpu.cfs_quota_us": quota, "cpu.max": f"{quota} 100000", "pids.max": limits["pids"]}
        for name, value in values.items():
            if (d / name).exists():
                (d / name).write_text(str(value))
    return dirs


def remove_cgroups() -> None:
    """Every learner's cgroup (their processes killed first), then our parent groups."""
    parents = [CGROUP_ROOT / CGROUP_NAME] + [CGROUP_ROOT / c / CGROUP_NAME for c in CONTROLLERS]
    for parent in parents:
        if not parent.is_dir():
            continue
        for child in [p for p in parent.iterdir() if p.is_dir()]:
            for _ in range(50):
                pids = [p for p in (child / "cgroup.procs").read_text().split() if p]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            child.rmdir()
        parent.rmdir()


def course_clone() -> Path:
    """A read-only clone of this checkout's HEAD: the learners' starting point (uncommitted work
    here does not reach them: commit first)."""
    course = HUB_DIR / "course"
    if not course.exists():
        _run("git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(course))
        _run("chmod", "-R", "a+rX,a-w", str(course))
    return course


def install_proxy() -> Path:
    proxy = HUB_DIR / "proxy"
    binary = proxy / "node_modules" / ".bin" / "configurable-http-proxy"
    if not binary.exists():
        proxy.mkdir(parents=True, exist_ok=True)
        _run("npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(proxy),
             f"configurable-http-proxy@{CHP_VERSION}")
    return binary


def closed_to_learners(path: Path) -> list[str]:
    """The folders on the way to `path` that other users may not pass through (no o+x)."""
    closed = []
    for folder in reversed(Path(os.path.realpath(path)).parents):
        if not os.stat(folder).st_mode & 0o001:
            closed.append(str(folder))
    return closed


def open_passage(folders: list[str]) -> None:
    """Let other users pass through (o+x, not list) these folders until `down`, which puts their
    modes back: they are written down first, so an interrupted run loses nothing `make hub-down`
    cannot restore."""
    HUB_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(HUB_DIR, 0o700)
    record = HUB_DIR / "opened.json"
    modes = json.loads(record.read_text()) if record.exists() else {}
    for folder in folders:
        modes.setdefault(folder, stat.S_IMODE(os.stat(folder).st_mode))
    record.write_text(json.dumps(modes, indent=1))
    for folder in folders:
        os.chmod(folder, modes[folder] | 0o001)


def close_passages() -> list[str]:
    """Put back the modes `open_passage` changed; what was restored, in words."""
    record = HUB_DIR / "opened.json"
    if not record.exists():
        return []
    done = []
    for folder, mode in json.loads(record.read_text()).items():
        if os.path.isdir(folder):
            os.chmod(folder, mode)
            done.append(f"put {folder} back to mode {mode:o}")
    record.unlink()
    return done


def slurm_settings(partition: str = "", time_limit: str = "", options: str = "") -> dict:
    """What the Slurm spawner submits with, once sbatch's cluster answers (hub/jupyterhub_config.py)."""
    for tool in ("sbatch", "squeue", "scancel", "sinfo"):
        if shutil.which(tool) is None:
            raise HubError(f"SPAWNER=slurm needs Slurm's {tool} on this machine (apt-get install slurm-client)")
    probe = subprocess.run(["sinfo", "-h", "-o", "%P %a %D"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        raise HubError(f"SPAWNER=slurm: sinfo cannot reach a Slurm cluster ({probe.stderr.strip()}); "
                       "SLURM_CONF names its slurm.conf (`make slurm-node` starts a one-node one here)")
    settings = {"partition": partition, "time": time_limit, "options": options}
    if os.environ.get("SLURM_CONF"):
        settings["conf"] = os.environ["SLURM_CONF"]
    return settings


def up(learners: list[str], password: str | None, port: int, limits: dict, spawner: str = "local",
       slurm: dict | None = None, hub_ip: str = "127.0.0.1") -> dict:
    reason = why_not()
    if reason:
        raise HubError(reason)
    if spawner not in ("local", "slurm"):
        raise HubError(f"SPAWNER={spawner}: say local (this machine, the default) or slurm")
    # the learners run the course's .venv, whose python is a link to the Python that made it
    closed = sorted(set(closed_to_learners(Path(sys.executable)) + closed_to_learners(Path(sys.prefix) / "bin")))
    if closed:
        raise HubError(f"learners cannot reach the course's Python ({os.path.realpath(sys.executable)}): "
                       f"{', '.join(closed)} lets only its owner pass. Either `chmod o+x {' '.join(closed)}` "
                       "(passing through, not listing) or make .venv from a Python all users can run: "
                       "rm -rf .venv && make setup PYTHON=/usr/bin/python3")
    if state_file().exists() and hub_pid() is not None:
        raise HubError(f"a hub is running already (pid {hub_pid()}): `make hub-down` stops it")
    password = password or secrets.token_urlsafe(9)
    if len(password) < 8:
        raise HubError("the workshop password needs at least 8 characters (JupyterHub's rule)")
    HUB_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(HUB_DIR, 0o755)
    state = HUB_DIR / "state"
    state.mkdir(exist_ok=True, mode=0o700)
    progress = HUB_DIR / "progress"
    progress.mkdir(exist_ok=True)
    os.chmod(progress, 0o1733)  # learners add their own file; nobody but root lists or reads others'
    settings = {"learners": learners, "password": password, "port": port, "limits": limits,
                "course": str(course_clone()), "progress": str(progress), "proxy": str(install_proxy()),
                "venv": str(Path(sys.prefix)), "state": str(state), "cgroup_name": CGROUP_NAME,
                "spawner": spawner, "hub_ip": hub_ip}
    if spawner == "slurm":
        settings["slurm"] = slurm if slurm is not None else slurm_settings()
    create_learners(learners)
    for login in learners if spawner == "local" else []:  # on Slurm, Slurm bounds each job
        make_cgroups(login, limits)
    state_file().write_text(json.dumps(settings, indent=1))
    os.chmod(state_file(), 0o600)
    log = open(state / "hub.log", "a")
    hub = subprocess.Popen([str(Path(sys.prefix) / "bin" / "jupyterhub"), "-f", str(ROOT / "hub" / "jupyterhub_config.py")],
                           cwd=state, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           env={**os.environ, "RINGSIDE_HUB_STATE": str(state_file())})
    (state / "hub.pid").write_text(str(hub.pid))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if hub.poll() is not None:
            raise HubError(f"JupyterHub exited ({hub.returncode}):\n{(state / 'hub.log').read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/hub/api", timeout=2)
            return settings
        except OSError:
            time.sleep(0.5)
    raise HubError(f"JupyterHub did not answer on 127.0.0.1:{port} within 120 s (log: {state / 'hub.log'})")


def hub_pid() -> int | None:
    try:
        pid = int((HUB_DIR / "state" / "hub.pid").read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def down() -> list[str]:
    """Stop everything `up` started, remove everything it made, put back the folder modes
    `open_passage` changed; what was done, in words."""
    reason = why_not()
    if reason:
        raise HubError(reason)
    done = []
    pid = hub_pid()
    if pid is not None:
        os.killpg(pid, signal.SIGTERM)  # the hub stops the proxy and the learners' servers
        for _ in range(100):
            if hub_pid() is None:
                break
            time.sleep(0.2)
        else:
            os.killpg(pid, signal.SIGKILL)
        done.append("stopped the hub and its proxy")
    settings = json.loads(state_file().read_text()) if state_file().exists() else {}
    learners = settings.get("learners", [])
    learners += [u.pw_name for u in pwd.getpwall() if ours(u.pw_name) and u.pw_name not in learners]
    if "slurm" in settings:
        done += cancel_jobs(learners, settings["slurm"])
    for login in learners:
        if ours(login):
            subprocess.run(["pkill", "-KILL", "-u", login], capture_output=True)
    remove_cgroups()
    for login in learners:
        if ours(login):
            for _ in range(20):  # userdel refuses while a process of the user is still going
                if subprocess.run(["userdel", "--remove", login], capture_output=True).returncode == 0:
                    break
                subprocess.run(["pkill", "-KILL", "-u", login], capture_output=True)
                time.sleep(0.2)
            else:
                raise HubError(f"could not remove the user {login}")
            done.append(f"removed user {login}")
    done += close_passages()
    if HUB_DIR.exists():
        shutil.rmtree(HUB_DIR)
        done.append(f"removed {HUB_DIR}")
    return done


def cancel_jobs(learners: list[str], slurm: dict) -> list[str]:
    """The learners' Slurm jobs the hub did not stop itself (it was killed, say), cancelled."""
    env = {**os.environ, **({"SLURM_CONF": slurm["conf"]} if "conf" in slurm else {})}
    ours_now = [login for login in learners if ours(login)]
    if not ours_now or shutil.which("scancel") is None:
        return []
    done = subprocess.run(["scancel", "--full", f"--user={','.join(ours_now)}"], capture_output=True, env=env)
    return ["cancelled the learners' Slurm jobs"] if done.returncode == 0 else []


def leftovers() -> list[str]:
    """What `down` should have removed and is still there (empty when clean)."""
    left = [u.pw_name for u in pwd.getpwall() if ours(u.pw_name)]
    left += [str(p) for p in [HUB_DIR, CGROUP_ROOT / CGROUP_NAME, *(CGROUP_ROOT / c / CGROUP_NAME for c in CONTROLLERS)]
             if p.exists()]
    procs = subprocess.run(["pgrep", "-f", "jupyterhub|configurable-http-proxy"], capture_output=True, text=True).stdout.split()
    return left + [f"process {p}" for p in procs if int(p) != os.getpid()]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hub", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the hub for the learners")
    p_up.add_argument("--learners", default=DEFAULT_LEARNERS, help="their logins, separated by spaces")
    p_up.add_argument("--password", default=os.environ.get("PASSWORD") or None, help="the workshop password (8+ characters; default: a random one, printed)")
    p_up.add_argument("--port", type=int, default=8000)
    p_up.add_argument("--cpus", type=float, default=LIMITS["cpus"], help="each learner's CPU quota, in cores")
    p_up.add_argument("--memory-gb", type=float, default=LIMITS["memory_gb"], help="each learner's memory limit")
    p_up.add_argument("--spawner", choices=("local", "slurm"), default="local",
                      help="where each learner's server runs: this machine, or a Slurm job")
    p_up.add_argument("--partition", default="", help="SPAWNER=slurm: the partition (default: the cluster's)")
    p_up.add_argument("--time", default="", help="SPAWNER=slurm: each server's time limit, e.g. 8:00:00")
    p_up.add_argument("--slurm-options", default="", help="SPAWNER=slurm: more sbatch options, e.g. --account=ws")
    p_up.add_argument("--hub-ip", default="127.0.0.1", help="where the servers reach the hub (SPAWNER=slurm on "
                      "other nodes: an address of this machine they can reach)")
    sub.add_parser("down", help="stop the hub, remove its learners, cgroups and files")
    p_room = sub.add_parser("room", help="the instructor's table: every learner's latest verdict per lab")
    p_room.add_argument("--watch", type=float, default=2)
    opts = parser.parse_args(argv)
    try:
        if opts.command == "up":
            limits = {**LIMITS, "cpus": opts.cpus, "memory_gb": opts.memory_gb}
            slurm = slurm_settings(opts.partition, opts.time, opts.slurm_options) if opts.spawner == "slurm" else None
            s = up(opts.learners.split(), opts.password, opts.port, limits, opts.spawner, slurm, opts.hub_ip)
            print(f"hub up: http://127.0.0.1:{s['port']}/  learners: {' '.join(s['learners'])}  "
                  f"password: {s['password']}\n  each learner: {limits['cpus']:g} CPU, {limits['memory_gb']:g} GB"
                  f"{' (a Slurm job each)' if opts.spawner == 'slurm' else ''}; "
                  f"`make room` shows who passed what; `make hub-down` removes it all")
        elif opts.command == "down":
            removed = down()
            print("hub down: " + (", ".join(removed) if removed else "nothing to remove (no hub)"))
            left = leftovers()
            if left:
                print("still there: " + ", ".join(left), file=sys.stderr)
                return 1
        else:
            from ringside import progress
            return progress.main(["--room", str(HUB_DIR / "progress"), "--watch", str(opts.watch)])
    except HubError as error:
        print(f"hub: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
