"""JupyterHub for a ringside workshop room: started by `make hub` (tools/hub.py), which writes the
settings this file reads (learners, password, port, limits, where things live) to a root-only file.

- Learners log in with their login and the shared workshop password (SharedPasswordAuthenticator).
- Each learner's server runs as their own Linux user (LocalProcessSpawner), inside cgroups of their
  own (CPU quota, memory limit, process count) joined before it drops root, so every kernel, rank
  and torchrun a learner starts stays inside their bound.
- At the first login the course is cloned into ~/ringside from the hub's read-only checkout.
- The kernel is the course's .venv (read-only for learners), with OMP_NUM_THREADS=1; `make lab`
  in the learner's clone uses that .venv instead of making one (RINGSIDE_VENV).
- Lab verdicts go to the hub's drop folder, where `make room` shows the instructor every learner's.
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
c.JupyterHub.hub_ip = "127.0.0.1"
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


c.JupyterHub.spawner_class = CourseSpawner
c.Spawner.pre_spawn_hook = clone_the_course
c.Spawner.cmd = [str(VENV / "bin" / "jupyterhub-singleuser")]
c.Spawner.notebook_dir = "~"
c.Spawner.default_url = "/lab/tree/ringside/README.md"
# window.jupyterapp in the page, as `make jupyter` gives: the room's browser test reads the notebook's state there
c.Spawner.args = ["--LabApp.expose_app_in_browser=True"]
c.Spawner.start_timeout = 180  # a room logging in at once on 2 cores
c.Spawner.http_timeout = 180
c.Spawner.environment = {
    "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
    "OMP_NUM_THREADS": "1",                                   # ranks share the learner's CPU quota
    "JUPYTER_PATH": str(VENV / "share" / "jupyter"),          # the course's kernel first
    "RINGSIDE_PROGRESS": S["progress"],                       # verdicts for the instructor's table
    "RINGSIDE_VENV": str(VENV),                               # make lab: the course's .venv, as it is
}
