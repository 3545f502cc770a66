"""Write each lab from its solution: the solution is the one source of truth.

In `solutions/NN_slug.py`, the learner's part sits between two markers:

        # BEGIN SOLUTION: wrap the model in DistributedDataParallel
        model = DDP(model)
        # END SOLUTION

and becomes, in `labs/NN_slug.py`,

        # TODO: wrap the model in DistributedDataParallel
        raise NotImplementedError("the TODO above")

The TODO says what to achieve, not the code. Help comes when the learner asks for it: lines
`# HINT 1: ...`, `# HINT 2: ...` directly above a BEGIN line stay out of the lab (it gets one line
saying where the hints are) and `make hint CH=NN` prints them for the first open TODO, one more
each time it is run (it remembers in .hints/), then points to the solution. Once no TODO is open,
it goes on from the lab's last FAIL instead (run_lab records it in .hints/NN.last-run.json): the
function the diagnosis concerns, the check's own next steps for that diagnosis, that function's hints,
then the solution, one step more specific each time.

Usage: python -m tools.labgen [--check]          (--check: exit 1 if labs/ differs, write nothing)
       python -m tools.labgen --hint NN          (the next hint for the first TODO still open in labs/NN_*)
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

HINT = re.compile(r"^\s*# HINT (?P<number>\d+): (?P<text>.*\S)\s*$")
STUB = "raise NotImplementedError(\"the TODO above\")"
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<todo>.*\S))?\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
SOLUTION_BANNER = "# SOLUTION FILE"
LAB_BANNER = ("# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).\n"
              "# (For maintainers: `make labs` writes this file from solutions/{name}; edit that one.)")


def make_lab(source: str, name: str = "the solution") -> str:
    """Return the lab text for one solution's source text."""
    out: list[str] = []
    todo: tuple[int, str] | None = None  # (line number, message) of the open block
    hints: list[str] = []  # hint lines waiting for the BEGIN line below them
    chapter = name[:2] if name[:2].isdigit() else "NN"
    for number, line in enumerate(source.splitlines(), start=1):
        begin = BEGIN.match(line)
        if todo is None and HINT.match(line):
            hints.append(line)
            continue
        if hints and not begin:
            raise ValueError(f"{name}:{number}: HINT lines must stand directly above a BEGIN SOLUTION line")
        if begin:
            if todo:
                raise ValueError(f"{name}:{number}: BEGIN SOLUTION inside the block opened at line {todo[0]}")
            message = begin["todo"]
            if not message:
                raise ValueError(f"{name}:{number}: BEGIN SOLUTION needs a TODO message after a colon")
            indent = begin["indent"]
            if hints:
                out.append(f"{indent}# (stuck? `make hint CH={chapter}` prints hint 1 of {len(hints)}; "
                           f"run it again for the next)")
                hints = []
            out.append(f"{indent}# TODO: {message}")
            out.append(f"{indent}{STUB}")
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


def hints_by_todo(source: str) -> dict[str, list[str]]:
    """TODO message -> its hints, in order, from a solution's source."""
    found: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in source.splitlines():
        hint, begin = HINT.match(line), BEGIN.match(line)
        if hint:
            pending.append(hint["text"])
        elif begin:
            found[begin["todo"]] = pending
            pending = []
        else:
            pending = []
    return found


def open_todos(lab_text: str) -> list[str]:
    """The TODO messages of a lab whose stub (`raise NotImplementedError`) is still there."""
    lines = lab_text.splitlines()
    return [line.split("# TODO: ", 1)[1].strip() for line, after in zip(lines, lines[1:])
            if "# TODO: " in line and after.strip() == STUB]


def show_hint(root: Path, chapter: str, level: int | None = None) -> int:
    """Print a hint for the first TODO still open in labs/<chapter>_*.py: hint `level`, or by
    default the one after the last shown for that TODO (remembered in root/.hints/)."""
    labs = sorted((root / "labs").glob(f"{chapter}_*.py"))
    if not labs:
        print(f"no lab for chapter {chapter} in {root / 'labs'}: make hint reads the lab in the course folder "
              f"it runs from")
        return 2
    lab, solution = labs[0], root / "solutions" / labs[0].name
    if not solution.exists():  # the hints and the diagnosis steps come from the finished twin
        print(f"make hint needs {solution.relative_to(root)} beside {lab.relative_to(root)} (its hints are "
              f"there): run it from the course folder, which has both")
        return 2
    todos = open_todos(lab.read_text())
    if not todos:
        return show_failure_hint(root, chapter, lab, solution, level)
    hints = hints_by_todo(solution.read_text()).get(todos[0], [])
    memory = root / ".hints" / f"{chapter}.json"
    shown = json.loads(memory.read_text()) if memory.exists() else {}
    if level is None:
        level = shown.get(todos[0], 0) + 1
    memory.parent.mkdir(exist_ok=True)
    memory.write_text(json.dumps({**shown, todos[0]: level}))
    print(f"First open TODO in {lab.relative_to(root)}: {todos[0]}")
    if level <= len(hints):
        print(f"Hint {level} of {len(hints)}: {hints[level - 1]}")
        if level < len(hints):
            print(f"(run `make hint CH={chapter}` again for hint {level + 1})")
    else:
        print(f"No hint {level}{f' (there are {len(hints)})' if hints else ''}. "
              f"Still stuck? The finished code is in {solution.relative_to(root)}.")
    return 0


DEF = re.compile(r"^(?P<indent>\s*)(?:async\s+)?def (?P<name>\w+)\(")


def blocks_by_function(source: str) -> dict[str, list[str]]:
    """Function name -> the TODO messages of the blocks inside it, in order (from a solution)."""
    found: dict[str, list[str]] = {}
    defs: list[tuple[int, str]] = []  # (indent, name) of the functions around the current line
    for line in source.splitlines():
        match, begin = DEF.match(line), BEGIN.match(line)
        if line.strip() and not line.lstrip().startswith(("#", ")", '"')):
            indent = len(line) - len(line.lstrip())
            defs = [d for d in defs if d[0] < indent]
        if match:
            defs.append((len(match["indent"]), match["name"]))
        elif begin and defs:
            found.setdefault(defs[-1][1], []).append(begin["todo"])
    return found


def function_at(text: str, line_number: int) -> str | None:
    """The function that a (1-based) line of a lab lies in."""
    lines = text.splitlines()[:line_number]
    indent = len(lines[-1]) - len(lines[-1].lstrip()) if lines else 0
    for line in reversed(lines):
        match = DEF.match(line)
        if match and len(match["indent"]) < indent:
            return match["name"]
    return None


def concerned_function(diagnosis: str, lab: Path, blocks: dict[str, list[str]]) -> str | None:
    """The learner's function a diagnosis is about: the line of the lab it points to, else the first
    of the lab's functions that it names, else the only one there is."""
    where = re.search(rf"labs/{re.escape(lab.name)}:(\d+)", diagnosis)
    if where:
        name = function_at(lab.read_text(), int(where[1]))
        if name in blocks:
            return name
    named = [name for name in blocks if re.search(rf"\b{re.escape(name)}\b", diagnosis)]
    if named:
        return min(named, key=lambda name: diagnosis.index(name))
    return next(iter(blocks)) if len(blocks) == 1 else None


def failure_steps(state: dict, lab: Path, solution: Path) -> list[str]:
    """The ladder for a failed run: where to look, the check's steps for that diagnosis, the hints
    of the function concerned, each one more specific than the last."""
    source = solution.read_text()
    blocks, hints = blocks_by_function(source), hints_by_todo(source)
    name = concerned_function(state["diagnosis"], lab, blocks)
    steps = []
    if name:
        todos = blocks[name]
        steps.append(f"the diagnosis is about `{name}` in {lab.parent.name}/{lab.name} (its TODO: {todos[0]}); "
                     f"reread its docstring: the check tests it on more inputs than the lab's own run")
    else:
        steps.append("the diagnosis names no function of yours: it is about the result of the whole run; "
                     "compare what it says was observed with what the lab's docstring asks for")
    steps += list(state.get("steps") or [])
    for todo in (blocks[name] if name else []):
        steps += [f"the TODO's hint {n} of {len(hints.get(todo, []))}: {hint}"
                  for n, hint in enumerate(hints.get(todo, []), start=1)]
    return steps


def show_failure_hint(root: Path, chapter: str, lab: Path, solution: Path, level: int | None = None) -> int:
    """The next step from the lab's last FAIL (recorded by run_lab), once no TODO is open."""
    state_file = root / ".hints" / f"{chapter}.last-run.json"
    shown_lab = lab.relative_to(root)
    if not state_file.exists():
        print(f"{shown_lab} has no open TODO, and no failed run of it is recorded: run it "
              f"(make lab CH={chapter}) and read its verdict; after a FAIL, `make hint CH={chapter}` goes on from it.")
        return 0
    state = json.loads(state_file.read_text())
    if state.get("sha256") != hashlib.sha256(lab.read_bytes()).hexdigest():
        print(f"{shown_lab} changed since its last run: run it again (make lab CH={chapter} "
              f"NPROC={state.get('world_size', 4)}), then `make hint CH={chapter}` goes on from its verdict.")
        return 0
    steps = failure_steps(state, lab, solution)
    level = level if level is not None else state.get("shown", 0) + 1
    state_file.write_text(json.dumps({**state, "shown": level}, indent=1))
    ranks = state.get("ranks", [])
    on = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    print(f"The last run of {shown_lab} ({state.get('world_size')} ranks) FAILED on {on}: {state['diagnosis']}")
    if level <= len(steps):
        print(f"Step {level} of {len(steps)}: {steps[level - 1]}")
        if level < len(steps):
            print(f"(run `make hint CH={chapter}` again for step {level + 1})")
    else:
        print(f"No step {level} (there are {len(steps)}). Still stuck? The finished code is in "
              f"{solution.relative_to(root)}.")
    return 0


def expected_labs(root: Path) -> dict[Path, str]:
    """Every lab path under root/labs and the text the generator makes for it."""
    return {
        root / "labs" / path.name: make_lab(path.read_text(), path.name)
        for path in sorted((root / "solutions").glob("[0-9][0-9]_*.py"))
    }


def main(argv: list[str]) -> int:
    root = Path.cwd()
    if argv[:1] == ["--hint"]:
        return show_hint(root, argv[1], int(argv[2]) if len(argv) > 2 else None)
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
