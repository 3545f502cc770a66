"""run_lab, the labs' self-check: crashes, deadlocks and wrong world sizes become clear verdicts."""

from __future__ import annotations

import textwrap

import pytest
from conftest import launch

HEADER = """
from datetime import timedelta
import torch, torch.distributed as dist
from ringside import run_lab
"""


def lab(tmp_path, body: str, run: str):
    path = tmp_path / "labs" / "99_probe.py"
    path.parent.mkdir()
    path.write_text(HEADER + textwrap.dedent(body) + f'\nif __name__ == "__main__":\n    {run}\n')
    return path


def test_a_crash_on_one_rank_is_reported_with_its_place(tmp_path):
    path = lab(tmp_path, """
        def main(me, checks):
            if dist.get_rank() == 1:
                raise ValueError("the learner's bug")
            checks.expect(True, "never shown")
        """, 'run_lab(main, title="probe")')
    result = launch(path, 2)
    assert result.returncode == 1
    assert "rank 0: PASS (1 checks)" in result.stdout
    assert "rank 1: FAIL - ValueError: the learner's bug (labs/99_probe.py:" in result.stdout
    assert "1 of 2 ranks FAIL" in result.stdout


def test_a_deadlock_becomes_a_likely_deadlock_verdict(tmp_path):
    path = lab(tmp_path, """
        def main(me, checks):
            t = torch.zeros(1)
            dist.recv(t, src=1 - dist.get_rank())  # both ranks receive first
        """, 'run_lab(main, title="probe", timeout=timedelta(seconds=3))')
    result = launch(path, 2, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    # each rank either timed out itself or saw its peer give up: a likely deadlock either way,
    # said once for both ranks when their diagnoses are the same
    verdicts = [line for line in result.stdout.splitlines() if ": FAIL - " in line]
    assert verdicts and all("likely a deadlock" in line for line in verdicts), result.stdout
    assert "2 of 2 ranks FAIL" in result.stdout


def test_a_world_size_the_check_cannot_tell_is_refused_with_its_reason(tmp_path):
    path = lab(tmp_path, "def main(me, checks):\n    checks.expect(True, '')\n",
               'run_lab(main, title="probe", refuse=lambda n: "a reason: run on 3" if n < 3 else None)')
    result = launch(path, 1)
    assert result.returncode != 0  # the ranks exit 2; torchrun itself reports any failure as 1
    assert result.stderr.strip() == "probe cannot check 1 rank: a reason: run on 3"
    assert launch(path, 3).returncode == 0


def test_one_rank_is_one_rank(tmp_path):
    path = lab(tmp_path, "def main(me, checks):\n    checks.expect(True, '')\n", 'run_lab(main, title="probe")')
    result = launch(path, 1)
    assert result.returncode == 0
    assert "self-check on 1 rank ==" in result.stdout and "The 1 rank PASSES." in result.stdout


def test_a_lab_that_checks_nothing_fails(tmp_path):
    path = lab(tmp_path, "def main(me, checks):\n    pass\n", 'run_lab(main, title="probe")')
    result = launch(path, 2)
    assert result.returncode == 1
    assert "ranks 0-1: FAIL - no check ran" in result.stdout


@pytest.mark.parametrize("nproc", [2])
def test_all_pass_exits_0(tmp_path, nproc):
    path = lab(tmp_path, "def main(me, checks):\n    checks.expect(me.world_size == 2 == dist.get_world_size(), 'x')\n",
               'run_lab(main, title="probe")')
    result = launch(path, nproc)
    assert result.returncode == 0
    assert "All 2 ranks PASS." in result.stdout


def raise_each_known_error(rank, world_size):
    """The real errors that ringside.lab.KNOWN_CAUSES explains, each raised on every rank alike."""
    import torch
    import torch.distributed as dist

    from ringside.lab import explain

    attempts = [  # in the order of KNOWN_CAUSES (its DataLoader entry is no collective: lab 11 plants it)
        lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(2, dtype=torch.float64)),
        lambda: dist.all_reduce(3.0),
        lambda: dist.all_gather([torch.zeros(2)], torch.ones(2)),
        lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2)),
        lambda: dist.broadcast(torch.zeros(2), src=world_size),
        lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG),
    ]
    verdicts = []
    for attempt in attempts:
        try:
            attempt()
            verdicts.append("no error")
        except Exception as error:  # noqa: BLE001 - each is explained, not raised
            verdicts.append(explain(error))
    return verdicts


def test_pytorch_errors_that_do_not_say_what_to_change_are_explained():
    """Held to this torch's real messages, so a reworded one shows here, not in front of a learner."""
    from ringside import run_ranks
    from ringside.lab import KNOWN_CAUSES

    verdicts = run_ranks(raise_each_known_error, 2, timeout=60, show_output=False)[0]
    causes = [cause for _, cause in KNOWN_CAUSES if "DataLoader" not in cause]
    assert len(verdicts) == len(causes)
    for verdict, cause in zip(verdicts, causes):
        assert verdict.endswith(cause), (verdict, cause)


def test_fail_lines_that_differ_in_one_number_are_one_line():
    from ringside.lab import verdict_lines

    verdicts = [(3, [f"rank {r}: the shard holds {n} rows, expected 4"]) for r, n in enumerate((3, 5, 3))]
    assert verdict_lines(verdicts + [(2, [])]) == [
        "ranks 0-2: FAIL - the shard holds 3 rows, expected 4 (likewise on rank 1, with 5 for 3)",
        "rank 3: PASS (2 checks)"]
    # two numbers differ, or other words: a line each
    assert verdict_lines([(1, ["a 1 b 2"]), (1, ["a 2 b 3"]), (1, ["c 1 b 2"])]) == [
        "rank 0: FAIL - a 1 b 2", "rank 1: FAIL - a 2 b 3", "rank 2: FAIL - c 1 b 2"]


def test_under_plain_torchrun_its_failure_report_ends_with_the_verdict(tmp_path, monkeypatch):
    """REVIEW D: torchrun follows a failing lab with its report of the failed processes, 30 lines and
    more; rank 0 leaves the verdict in torchrun's error file, so the report's last block shows it.
    Held to torch's own report (ChildFailedError.format_msg), as torchrun prints it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ringside.lab import tell_torchrun

    lines = ["ranks 0-1: FAIL - unfinished - TODO: pass the token (labs/02_p2p.py:31)",
             "2 of 2 ranks FAIL: fix the first message above and run again."]
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    tell_torchrun(lines)
    failures = {0: ProcessFailure(0, 100, 1, str(error_file)),
                1: ProcessFailure(1, 101, 1, str(tmp_path / "none.json"))}  # rank 1 wrote none
    report = ChildFailedError("labs/02_p2p.py", failures).format_msg().rstrip("=\n ").splitlines()
    assert [line.strip() for line in report[-2:]] == lines, report
    assert "Root Cause" in "\n".join(report[-10:]) and "rank      : 0 " in "\n".join(report[-10:]), report
