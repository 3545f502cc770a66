"""The generator that writes labs/ from solutions/."""

import pytest

from tools.labgen import hints_by_todo, make_lab, show_hint

SOLUTION = '''def f(x):
    # BEGIN SOLUTION: double x
    return 2 * x
    # END SOLUTION
'''


def test_block_becomes_todo_and_raise():
    lab = make_lab(SOLUTION)
    assert "return 2 * x" not in lab
    # the TODO's text is written once, in the comment that the stub's error points to
    assert '    # TODO: double x\n    raise NotImplementedError("the TODO above")\n' in lab
    assert lab.count("double x") == 1
    namespace = {}
    exec(lab, namespace)
    with pytest.raises(NotImplementedError, match="the TODO above"):
        namespace["f"](1)


def test_hints_stay_out_of_the_lab_and_come_on_request(tmp_path, capsys):
    solution = "def f(x):\n    # HINT 1: twice\n    # HINT 2: x + x\n" + SOLUTION.split("\n", 1)[1]
    lab = make_lab(solution, "07_demo.py")
    assert "HINT" not in lab and "x + x" not in lab
    assert "make hint CH=07` prints hint 1 of 2; run it again for the next" in lab
    assert hints_by_todo(solution) == {"double x": ["twice", "x + x"]}
    (tmp_path / "labs").mkdir()
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs" / "07_demo.py").write_text(lab)
    (tmp_path / "solutions" / "07_demo.py").write_text(solution)
    show_hint(tmp_path, "07")
    out = capsys.readouterr().out
    assert "First open TODO in labs/07_demo.py: double x" in out and "Hint 1 of 2: twice" in out
    show_hint(tmp_path, "07")  # each run shows the next hint
    assert "Hint 2 of 2: x + x" in capsys.readouterr().out
    show_hint(tmp_path, "07")
    assert "The finished code is in solutions/07_demo.py" in capsys.readouterr().out
    (tmp_path / "labs" / "07_demo.py").write_text(solution)  # the learner finished it
    show_hint(tmp_path, "07")
    assert "has no open TODO" in capsys.readouterr().out


def test_hint_without_solutions_says_so_in_one_line(tmp_path, capsys):
    """A lab copied out of the checkout has no solutions/ beside it: one line, not a traceback."""
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "07_demo.py").write_text(make_lab(SOLUTION, "07_demo.py"))
    assert show_hint(tmp_path, "07") == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs solutions/07_demo.py beside labs/07_demo.py" in out, out
    assert show_hint(tmp_path, "08") == 2 and "no lab for chapter 08" in capsys.readouterr().out


def test_text_outside_blocks_is_kept():
    assert make_lab("a = 1\n" + SOLUTION + "b = 2\n").startswith("a = 1\n")
    assert make_lab("a = 1\n" + SOLUTION + "b = 2\n").endswith("b = 2\n")


@pytest.mark.parametrize("bad, message", [
    ("# BEGIN SOLUTION\nx\n# END SOLUTION\n", "needs a TODO message"),
    ("# BEGIN SOLUTION: a\n# BEGIN SOLUTION: b\n", "inside the block"),
    ("# END SOLUTION\n", "without BEGIN"),
    ("# BEGIN SOLUTION: a\nx\n", "never closed"),
    ("# HINT 1: a\nx = 1\n", "directly above a BEGIN"),
])
def test_malformed_markers_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        make_lab(bad)
