"""The generator that writes labs/ from solutions/."""

import pytest

from ringside.labgen import make_lab

SOLUTION = '''def f(x):
    # BEGIN SOLUTION: double x
    return 2 * x
    # END SOLUTION
'''


def test_block_becomes_todo_and_raise():
    lab = make_lab(SOLUTION)
    assert "return 2 * x" not in lab
    assert "    # TODO: double x\n    raise NotImplementedError('TODO: double x')\n" in lab
    namespace = {}
    exec(lab, namespace)
    with pytest.raises(NotImplementedError, match="TODO: double x"):
        namespace["f"](1)


def test_text_outside_blocks_is_kept():
    assert make_lab("a = 1\n" + SOLUTION + "b = 2\n").startswith("a = 1\n")
    assert make_lab("a = 1\n" + SOLUTION + "b = 2\n").endswith("b = 2\n")


@pytest.mark.parametrize("bad, message", [
    ("# BEGIN SOLUTION\nx\n# END SOLUTION\n", "needs a TODO message"),
    ("# BEGIN SOLUTION: a\n# BEGIN SOLUTION: b\n", "inside the block"),
    ("# END SOLUTION\n", "without BEGIN"),
    ("# BEGIN SOLUTION: a\nx\n", "never closed"),
])
def test_malformed_markers_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        make_lab(bad)
