"""Write each lab from its solution: the solution is the one source of truth.

In `solutions/NN_slug.py`, the learner's part sits between two markers:

        # BEGIN SOLUTION: wrap the model in DistributedDataParallel
        model = DDP(model)
        # END SOLUTION

and becomes, in `labs/NN_slug.py`,

        # TODO: wrap the model in DistributedDataParallel
        raise NotImplementedError("TODO: wrap the model in DistributedDataParallel")

Usage: python -m ringside.labgen [--check]   (--check: exit 1 if labs/ differs, write nothing)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<todo>.*\S))?\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
SOLUTION_BANNER = "# SOLUTION FILE"
LAB_BANNER = ("# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).\n"
              "# (For maintainers: `make labs` writes this file from solutions/{name}; edit that one.)")


def make_lab(source: str, name: str = "the solution") -> str:
    """Return the lab text for one solution's source text."""
    out: list[str] = []
    todo: tuple[int, str] | None = None  # (line number, message) of the open block
    for number, line in enumerate(source.splitlines(), start=1):
        begin = BEGIN.match(line)
        if begin:
            if todo:
                raise ValueError(f"{name}:{number}: BEGIN SOLUTION inside the block opened at line {todo[0]}")
            message = begin["todo"]
            if not message:
                raise ValueError(f"{name}:{number}: BEGIN SOLUTION needs a TODO message after a colon")
            indent = begin["indent"]
            out.append(f"{indent}# TODO: {message}")
            out.append(f"{indent}raise NotImplementedError({('TODO: ' + message)!r})")
            todo = (number, message)
        elif END.match(line):
            if not todo:
                raise ValueError(f"{name}:{number}: END SOLUTION without BEGIN SOLUTION")
            todo = None
        elif todo is None:
            if line.startswith(SOLUTION_BANNER):
                line = LAB_BANNER.format(name=name)
            out.append(line)
    if todo:
        raise ValueError(f"{name}: the block opened at line {todo[0]} is never closed")
    return "\n".join(out) + "\n"


def expected_labs(root: Path) -> dict[Path, str]:
    """Every lab path under root/labs and the text the generator makes for it."""
    return {
        root / "labs" / path.name: make_lab(path.read_text(), path.name)
        for path in sorted((root / "solutions").glob("[0-9][0-9]_*.py"))
    }


def main(argv: list[str]) -> int:
    root = Path.cwd()
    check = "--check" in argv
    drift = []
    for path, text in expected_labs(root).items():
        if path.exists() and path.read_text() == text:
            continue
        drift.append(path)
        if not check:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(root)}")
    if check and drift:
        print("labs/ differs from what `make labs` makes: " + ", ".join(str(p.relative_to(root)) for p in drift))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
