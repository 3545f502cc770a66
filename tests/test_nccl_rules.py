"""What nccl would reject or ignore, kept out of every lab, solution, check and notebook (it cannot run here).

NCCL ignores `tag` (messages between two ranks are matched in order), has no receive from any
source (`recv` without `src`), and moves only CUDA tensors. A lab that relies on tags or on an
any-source receive is right on gloo and wrong on a GPU machine, so the course's code never does.
"""

from __future__ import annotations

import ast
import json

import pytest
from conftest import ROOT

P2P = {"send", "recv", "isend", "irecv", "P2POp"}


def sources():
    scripts = [*sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py")), *sorted((ROOT / "labs").glob("[0-9][0-9]_*.py")),
               *sorted((ROOT / "checks").glob("lab[0-9][0-9].py"))]
    for path in scripts:
        yield path.relative_to(ROOT), path.read_text()
    for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = [("".join(c["source"]), c.get("metadata", {}).get("tags", [])) for c in cells if c["cell_type"] == "code"]
        # a cell tagged gloo-only shows what gloo allows (and says so); it is not course code to copy
        yield path.relative_to(ROOT), "\n".join(src for src, tags in code if "gloo-only" not in tags)


def p2p_calls(text: str):
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in P2P:
                yield name, node


@pytest.mark.parametrize("path, text", [pytest.param(p, t, id=str(p)) for p, t in sources()])
def test_no_tags_and_no_receive_from_any_source(path, text):
    problems = []
    for name, call in p2p_calls(text):
        keywords = {k.arg for k in call.keywords}
        if "tag" in keywords:
            problems.append(f"line {call.lineno}: {name}(..., tag=...) - nccl ignores tags")
        if name in ("recv", "irecv") and "src" not in keywords and len(call.args) < 2:
            problems.append(f"line {call.lineno}: {name} without src - nccl has no receive from any source")
    assert not problems, f"{path}:\n" + "\n".join(problems)
