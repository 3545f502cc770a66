"""`make hint CH=NN` after a FAIL (REVIEW D.4): once no TODO is open, the hint goes on from the lab's
last verdict (run_lab records it in .hints/NN.last-run.json), one step more specific each time."""

from __future__ import annotations

import pytest
from conftest import ROOT, launch

from tools.labgen import show_hint

CASES = [  # (stem, text of the solution, the learner's mistake, ranks, words of the first step, of a later step)
    ("00_setup", "(mine, op=dist.ReduceOp.SUM)", "(mine, op=dist.ReduceOp.MAX)", 3,
     "`sum_over_ranks`", "the TODO's hint 2 of 2"),
    ("06_sampler", "generator.manual_seed(seed + epoch)", "generator.manual_seed(seed)", 2,
     "`shard_indices`", "the TODO's hint 3 of 3"),
]


@pytest.mark.parametrize("stem, old, new, nproc, first, later", CASES, ids=[c[0] for c in CASES])
def test_hint_after_a_fail_goes_one_step_deeper_each_time(stem, old, new, nproc, first, later, tmp_path, capsys):
    chapter = stem[:2]
    solution = (ROOT / "solutions" / f"{stem}.py").read_text()
    (tmp_path / "labs").mkdir()
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / f"{stem}.py").write_text(solution)
    lab = tmp_path / "labs" / f"{stem}.py"
    lab.write_text(solution.replace(old, new))  # written code, no TODO open, that FAILs
    show_hint(tmp_path, chapter)
    assert "no failed run of it is recorded" in capsys.readouterr().out

    result = launch(lab, nproc)
    assert result.returncode != 0 and "FAIL" in result.stdout, result.stdout[-2000:]
    diagnosis = next(line for line in result.stdout.splitlines() if ": FAIL - " in line).split(": FAIL - ", 1)[1]

    said = []
    for _ in range(12):
        show_hint(tmp_path, chapter)
        said.append(capsys.readouterr().out)
        if "The finished code is in" in said[-1]:
            break
    assert all(diagnosis in out for out in said), said[0]  # every step says which FAIL it goes on from
    assert "Step 1 of " in said[0] and first in said[0], said[0]
    steps = [out.split("Step ", 1)[1].split(": ", 1)[1] for out in said[:-1]]
    assert len(set(steps)) == len(steps) >= 3, said  # each call a new step
    assert any(later in step for step in steps), steps
    assert f"solutions/{stem}.py" in said[-1]

    lab.write_text(lab.read_text() + "\n")  # the learner changes the code: the old verdict no longer applies
    show_hint(tmp_path, chapter)
    assert "changed since its last run" in capsys.readouterr().out

    lab.write_text(solution)  # fixed: the run PASSES and clears the record
    assert launch(lab, nproc).returncode == 0
    assert not (tmp_path / ".hints" / f"{chapter}.last-run.json").exists()
