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
