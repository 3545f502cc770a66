"""The workshop room's JupyterHub configuration, read as JupyterHub reads it, for both spawners: what
each learner's server gets (the bounds, the course's environment, idle culling), without starting a
hub (`make hub-test` does that, as root, in a browser). Skipped where JupyterHub and batchspawner are
not installed (requirements-hub.txt: `make hub` installs them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tools import slurm_node

ROOT = Path(__file__).resolve().parent.parent


def hub_config(tmp_path, monkeypatch, **settings):
    pytest.importorskip("jupyterhub")
    pytest.importorskip("batchspawner")
    from traitlets.config.loader import PyFileConfigLoader

    state = {"learners": ["ada", "bob"], "password": "x" * 8, "port": 8000, "state": str(tmp_path),
             "venv": "/opt/course/.venv", "course": "/srv/course", "progress": "/srv/progress", "proxy": "chp",
             "cgroup_name": "ringside-hub", "limits": {"cpus": 1.0, "memory_gb": 2.0, "pids": 1024}, **settings}
    (tmp_path / "hub.json").write_text(json.dumps(state))
    monkeypatch.setenv("RINGSIDE_HUB_STATE", str(tmp_path / "hub.json"))
    return PyFileConfigLoader("jupyterhub_config.py", path=str(ROOT / "hub")).load_config()


def test_every_learner_gets_forked_ranks_their_clone_and_idle_culling(tmp_path, monkeypatch):
    c = hub_config(tmp_path, monkeypatch, spawner="local")
    assert c.JupyterHub.spawner_class.__name__ == "CourseSpawner"
    env = c.Spawner.environment
    assert env["RINGSIDE_LAUNCH"] == "fork" and env["OMP_NUM_THREADS"] == "1"
    assert callable(env["PYTHONPATH"])  # the learner's own clone, found when their server starts
    assert any(a.startswith("--MappingKernelManager.cull_idle_timeout=") for a in c.Spawner.args)
    culler = c.JupyterHub.services[0]
    assert culler["name"] == "idle-culler" and "jupyterhub_idle_culler" in culler["command"]
    assert "delete:servers" in c.JupyterHub.load_roles[0]["scopes"]


def test_on_slurm_each_server_is_a_job_of_the_learner_with_the_same_bounds(tmp_path, monkeypatch):
    slurm = {"partition": "workshop", "time": "8:00:00", "options": "--account=ws", "conf": "/etc/slurm/x.conf"}
    c = hub_config(tmp_path, monkeypatch, spawner="slurm", slurm=slurm, hub_ip="10.0.0.5")
    assert c.JupyterHub.spawner_class == "batchspawner.SlurmSpawner"
    s = c.SlurmSpawner
    assert s.batch_submit_cmd == "sbatch --parsable --uid={username} --gid={username}" and s.exec_prefix == ""
    assert (s.req_partition, s.req_runtime, s.req_options) == ("workshop", "8:00:00", "--account=ws")
    assert (s.req_nprocs, s.req_memory) == ("1", "2048M")
    assert "--get-user-env" not in s.batch_script and "#SBATCH --mem={{memory}}" in s.batch_script
    assert s.batchspawner_singleuser_cmd == "/opt/course/.venv/bin/batchspawner-singleuser"
    assert c.Spawner.environment["SLURM_CONF"] == "/etc/slurm/x.conf" and c.JupyterHub.hub_ip == "10.0.0.5"
    assert "--ServerApp.ip=0.0.0.0" in c.Spawner.args  # the hub's proxy reaches it on its node


@pytest.mark.skipif(shutil.which("slurmd", path="/usr/sbin:/usr/bin") is None, reason="no slurmd (slurm-wlm)")
def test_the_one_node_slurm_bounds_jobs_in_cgroups_only_when_asked(tmp_path):
    bounded = slurm_node.Cluster(tmp_path, cgroups=True).slurm_conf()
    plain = slurm_node.Cluster(tmp_path).slurm_conf()
    assert "TaskPlugin=task/cgroup" in bounded and "SelectTypeParameters=CR_CPU_Memory" in bounded
    assert "TaskPlugin=task/none" in plain and "SelectTypeParameters=CR_CPU\n" in plain
    assert "RealMemory=" in plain  # --mem is checked against the node's memory
