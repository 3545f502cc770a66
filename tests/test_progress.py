"""Every learner's lab run is recorded for `make progress` and the instructor's `make room`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import ROOT, launch

from ringside import progress


def test_a_learners_runs_are_recorded_and_the_latest_verdict_shown(tmp_path):
    """A learner's lab (a file in labs/) that fails, then passes: both recorded in their own file
    (mode 600), the table shows the latest; a solution's run is not recorded."""
    clone = tmp_path / "clone"
    (clone / "labs").mkdir(parents=True)
    lab = clone / "labs" / "00_setup.py"
    shutil.copy(ROOT / "labs" / "00_setup.py", lab)
    env = {"RINGSIDE_PROGRESS": str(tmp_path / "progress")}
    assert launch(lab, 2, env=env).returncode != 0          # the stub: its first TODO is open
    shutil.copy(ROOT / "solutions" / "00_setup.py", lab)
    assert launch(lab, 3, env=env).returncode == 0
    assert launch(ROOT / "solutions" / "00_setup.py", 2, env=env).returncode == 0  # not a learner's lab
    files = list((tmp_path / "progress").iterdir())
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
    runs = files[0].read_text().splitlines()
    assert len(runs) == 2 and '"FAIL"' in runs[0] and "TODO" in runs[0]
    table = progress.latest(tmp_path / "progress")
    (learner,) = table
    assert table[learner]["00"]["verdict"] == "PASS" and table[learner]["00"]["world_size"] == 3
    shown = progress.render(table, details=True)
    assert "PASS 3" in shown.splitlines()[1]


def test_make_progress_shows_the_learners_own_table(tmp_path):
    (tmp_path / "p").mkdir()
    env = {**os.environ, "RINGSIDE_PROGRESS": str(tmp_path / "p")}
    subprocess.run([sys.executable, "-c", "from ringside import progress; progress.record('04', 2, False, 'rank 1: off by one')"],
                   env=env, check=True, timeout=60)
    out = subprocess.run(["make", "-s", "progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "FAIL 2" in out.stdout and "rank 1: off by one" in out.stdout
