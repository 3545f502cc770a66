"""Run a chapter notebook top to bottom without Jupyter and compare its text outputs, as nbval does.

For GPU machines that have PyTorch but not the Jupyter stack (and no network to install it):
`make test-gpu` uses nbval where it is installed and this otherwise. Each code cell is executed in
one namespace, in the notebook's folder; what it prints (and the value of its last expression) is
compared with the stored output after the substitutions of tests/sanitize.cfg. Cells tagged
`nbval-ignore-output` run but are not compared; images are never compared. A cell that needs
IPython or ipywidgets, where they are missing, is reported as skipped.

Usage: python tests/gpu/nbrun.py chapters/NN_slug.ipynb   (exit 1 on the first difference)
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import io
import json
import os
import re
import sys
import traceback
from pathlib import Path

from ringside.launch import ROOT  # noqa: E402 - make test-gpu puts the course on PYTHONPATH


def sanitizers() -> list[tuple[re.Pattern, str]]:
    config = configparser.ConfigParser()
    config.read(ROOT / "tests" / "sanitize.cfg")
    return [(re.compile(config[s]["regex"]), config[s]["replace"]) for s in config.sections()]


def sanitize(text: str, rules) -> str:
    for pattern, replacement in rules:
        text = pattern.sub(replacement, text)
    return text


def stored_text(cell: dict) -> str:
    """What nbval compares of a stored cell: stdout streams and text/plain results, in order."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream" and out["name"] == "stdout":
            parts.append("".join(out["text"]))
        elif out["output_type"] == "execute_result":
            parts.append("".join(out["data"].get("text/plain", "")) + "\n")
    return "".join(parts)


def run_cell(source: str, namespace: dict) -> str:
    """Execute one cell like a kernel: the last expression's repr is shown, unless it is None."""
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
            if value is not None and not source.rstrip().endswith(";"):
                print(repr(value))
    return buffer.getvalue()


def main(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")  # figures are drawn but not shown (nbval does not compare images either)
    notebook = Path(path).resolve()
    cells = json.loads(notebook.read_text())["cells"]
    os.chdir(notebook.parent)
    sys.path.insert(0, str(notebook.parent))
    rules = sanitizers()
    namespace = {"__name__": "__main__"}
    compared = skipped = 0
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tags = cell.get("metadata", {}).get("tags", [])
        try:
            got = run_cell(source, namespace)
        except ModuleNotFoundError as missing:
            if missing.name and missing.name.split(".")[0] in ("IPython", "ipywidgets"):
                skipped += 1
                print(f"{notebook.name} cell {index}: skipped, it needs {missing.name} (Jupyter)")
                continue
            raise
        except Exception:
            if "raises-exception" in tags:
                continue
            print(f"{notebook.name} cell {index} raised:\n{traceback.format_exc()}")
            return 1
        if "nbval-ignore-output" in tags or "nbval-skip" in tags:
            continue
        want, have = sanitize(stored_text(cell), rules), sanitize(got, rules)
        if want != have:
            print(f"{notebook.name} cell {index}: output differs from the stored one\n"
                  f"--- stored\n{want}\n--- now\n{have}")
            return 1
        compared += 1
    print(f"{notebook.name}: {compared} cells compared, {skipped} skipped, no difference")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
