"""JupyterHub for a ringside workshop room: started by `make hub` (tools/hub.py), which writes the
settings this file reads (learners, password, port, limits, where things live) to a root-only file.

- Learners log in with their login and the shared workshop password (SharedPasswordAuthenticator).
- Each learner's server runs as their own Linux user (LocalProcessSpawner), inside cgroups of their
  own (CPU quota, memory limit, process count) joined before it drops root, so every kernel, rank
  and torchrun a learner starts stays inside their bound. Or (`make hub SPAWNER=slurm`) as a Slurm
  job of that user (batchspawner's SlurmSpawner), which Slurm bounds: --cpus-per-task, --mem.
- At the first login the course is cloned into ~/ringside from the hub's read-only checkout.
- The kernel is the course's .venv (read-only for learners), with OMP_NUM_THREADS=1; `make lab`
  in the learner's clone uses that .venv instead of making one (RINGSIDE_VENV).
- Lab verdicts go to the hub's drop folder, where `make room` shows the instructor every learner's.
- A notebook's ranks are forked from one process that imported torch (RINGSIDE_LAUNCH=fork), idle
  kernels are shut down and idle servers stopped (jupyterhub-idle-culler): what lets one box hold
  twice the learners (docs/INSTRUCTORS.md, "how many learners one box holds").
"""

import json
import os
import pwd
import shutil
import subprocess
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner

c = get_config()  # noqa: F821 - JupyterHub's config loader defines it

S = json.loads(Path(os.environ["RINGSIDE_HUB_STATE"]).read_text())
STATE, VENV = Path(S["state"]), Path(S["venv"])

c.JupyterHub.ip = "127.0.0.1"  # the room reaches it through the instructor's own tunnel or proxy
c.JupyterHub.port = S["port"]
# where the learners' servers reach the hub: 127.0.0.1 on one box; a Slurm cluster's nodes need an
# address of this machine they can reach (HUB_IP)
c.JupyterHub.hub_ip = S.get("hub_ip", "127.0.0.1")
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
c.ConfigurableHTTPProxy.command = [S["proxy"]]
c.ConfigurableHTTPProxy.pid_file = str(STATE / "proxy.pid")

c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = S["password"]
c.Authenticator.allowed_users = set(S["learners"])


class CourseSpawner(LocalProcessSpawner):
    """A learner's server as that learner, inside the learner's cgroups."""

    def make_preexec_fn(self, name):
        drop_root = super().make_preexec_fn(name)
        procs = [Path(d) / "cgroup.procs" for d in self.cgroup_dirs(name)]

        def preexec():
            for path in procs:  # still root here: join the learner's groups, then become the learner
                path.write_text(str(os.getpid()))
            drop_root()
        return preexec

    @staticmethod
    def cgroup_dirs(name):
        root = Path("/sys/fs/cgroup")
        if (root / "cgroup.controllers").exists():
            return [root / S["cgroup_name"] / name]
        return [root / c / S["cgroup_name"] / name for c in ("cpu", "memory", "pids") if (root / c).is_dir()]


def clone_the_course(spawner):
    """~/ringside, the learner's own clone of the hub's read-only checkout, made at the first login."""
    user = pwd.getpwnam(spawner.user.name)
    clone = Path(user.pw_dir) / "ringside"
    if not clone.exists():
        subprocess.run(["git", "clone", "--quiet", S["course"], str(clone)], check=True)
        shutil.chown(clone, user.pw_uid, user.pw_gid)
        for path in clone.rglob("*"):
            os.lchown(path, user.pw_uid, user.pw_gid)


def learner_clone(spawner):
    return str(Path(pwd.getpwnam(spawner.user.name).pw_dir) / "ringside")


c.Spawner.pre_spawn_hook = clone_the_course
c.Spawner.cmd = [str(VENV / "bin" / "jupyterhub-singleuser")]
# A kernel idle this long is shut down, with its rank starter and their torch (about 0.7 GB), even with
# its notebook open: a learner who moved on to the next chapter leaves the last one's kernel behind.
# Running the notebook again starts a new one.
KERNEL_IDLE_S = 20 * 60
KERNEL_CULLING = [f"--MappingKernelManager.cull_idle_timeout={KERNEL_IDLE_S}",
                  "--MappingKernelManager.cull_interval=60", "--MappingKernelManager.cull_connected=True"]
c.Spawner.notebook_dir = "~"
c.Spawner.default_url = "/lab/tree/ringside/README.md"
# window.jupyterapp in the page, as `make jupyter` gives: the room's browser test reads the notebook's state there
c.Spawner.args = ["--LabApp.expose_app_in_browser=True", *KERNEL_CULLING]
c.Spawner.start_timeout = 180  # a room logging in at once on 2 cores
c.Spawner.http_timeout = 180
c.Spawner.environment = {
    "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
    "OMP_NUM_THREADS": "1",                                   # ranks share the learner's CPU quota
    "JUPYTER_PATH": str(VENV / "share" / "jupyter"),          # the course's kernel first
    "RINGSIDE_PROGRESS": S["progress"],                       # verdicts for the instructor's table
    "RINGSIDE_VENV": str(VENV),                               # make lab: the course's .venv, as it is
    "RINGSIDE_LAUNCH": "fork",                                # a notebook's torchrun: ranks forked (ringside.launch)
    "PYTHONPATH": learner_clone,                              # the kernel imports the course from the clone it runs
}

# A server idle this long (no browser tab, no kernel busy) is stopped; the learner's files stay, and
# logging in again starts it again.
SERVER_IDLE_S = 60 * 60
c.JupyterHub.services = [{"name": "idle-culler", "command": [
    str(VENV / "bin" / "python"), "-m", "jupyterhub_idle_culler", f"--timeout={SERVER_IDLE_S}"]}]
c.JupyterHub.load_roles = [{"name": "idle-culler", "services": ["idle-culler"],
                            "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}]

if S.get("spawner", "local") == "local":
    c.JupyterHub.spawner_class = CourseSpawner
else:
    import batchspawner  # noqa: F401 - also adds the hub's API the job's server reports its port to

    c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
    # The hub runs as root: it submits as the learner (sbatch --uid/--gid), no sudo needed
    c.SlurmSpawner.exec_prefix = ""
    c.SlurmSpawner.batch_submit_cmd = "sbatch --parsable --uid={username} --gid={username}"
    # batchspawner's own script, less --get-user-env (slurmd would run `su - learner` to read a login
    # environment: the job gets the spawner's, below, which is all it needs)
    c.SlurmSpawner.batch_script = batchspawner.SlurmSpawner.batch_script.default_value.replace(
        "#SBATCH --get-user-env=L\n", "")
    c.SlurmSpawner.batchspawner_singleuser_cmd = str(VENV / "bin" / "batchspawner-singleuser")
    slurm = S["slurm"]
    c.SlurmSpawner.req_partition = slurm.get("partition", "")
    c.SlurmSpawner.req_runtime = slurm.get("time", "")
    c.SlurmSpawner.req_options = slurm.get("options", "")
    # the same bound as on one box, which Slurm enforces where slurm.conf says TaskPlugin=task/cgroup
    c.SlurmSpawner.req_nprocs = str(max(1, int(S["limits"]["cpus"])))
    c.SlurmSpawner.req_memory = f"{int(S['limits']['memory_gb'] * 1024)}M"
    # on a node that is not this machine the server must listen where the hub's proxy reaches it
    c.Spawner.args.append(f"--ServerApp.ip={slurm.get('server_ip', '0.0.0.0')}")
    c.Spawner.start_timeout = 300  # a job may wait in the queue
    if "conf" in slurm:  # sbatch, squeue and scancel run with the spawner's environment only
        c.Spawner.environment["SLURM_CONF"] = slurm["conf"]
