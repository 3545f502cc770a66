"""A lab's refusal of a world size is printed every time, whichever rank exits first (REVIEW A: lab
14 at 5 ranks printed its line in 1 of 4 runs: another rank exited with status 2 before rank 0
printed, and torchrun then stopped rank 0)."""

from __future__ import annotations

import textwrap

import pytest
from conftest import launch

# Rank 0 decides the refusal a second after the others: without a wait in run_lab, the others exit
# first and torchrun stops rank 0 before it prints, every time.
SLOW_RANK_0 = textwrap.dedent("""
    import os
    import time

    from ringside import run_lab

    def refuse(world_size):
        if os.environ["RANK"] == "0":
            time.sleep(1.0)
        return f"a refusal at {world_size} ranks that rank 0 reaches last"

    run_lab(lambda me, checks: None, title="Lab 99 (race)", refuse=refuse)
""")


@pytest.mark.parametrize("attempt", range(3))
def test_refusal_is_printed_although_other_ranks_are_ready_to_exit_first(attempt, tmp_path):
    script = tmp_path / "99_race.py"
    script.write_text(SLOW_RANK_0)
    result = launch(script, 2, torchrun=True, timeout=120)
    said = [line for line in result.stderr.splitlines() if " cannot check " in line]
    assert result.returncode != 0
    assert said == ["Lab 99 (race) cannot check 2 ranks: a refusal at 2 ranks that rank 0 reaches last"], \
        result.stderr[-3000:]


def test_make_lab_imports_the_checks_of_the_labs_own_clone(tmp_path):
    """REVIEW D.8: clones sharing one .venv have `checks` installed from whichever ran `make setup`
    last; `make lab` (python -m ringside) in another clone must run that clone's own check."""
    import shutil
    import subprocess
    import sys

    from conftest import ROOT
    from ringside.launch import quiet_env

    (tmp_path / "labs").mkdir()
    shutil.copy(ROOT / "solutions" / "00_setup.py", tmp_path / "labs" / "00_setup.py")
    shutil.copytree(ROOT / "checks", tmp_path / "checks", ignore=shutil.ignore_patterns("__pycache__"))
    check = tmp_path / "checks" / "lab00.py"
    check.write_text(check.read_text().replace('title="Lab 00 (setup)"', 'title="Lab 00 (setup) of clone B"'))
    result = subprocess.run([sys.executable, "-m", "ringside", "1", str(tmp_path / "labs" / "00_setup.py")],
                            cwd=ROOT, env=quiet_env(), capture_output=True, text=True, timeout=180)
    assert "== Lab 00 (setup) of clone B: self-check on 1 rank ==" in result.stdout, result.stdout + result.stderr[-2000:]
