"""Every lab run's verdict, kept for its learner, and the table of who passed what.

Each time a learner runs a lab (a file in `labs/`), rank 0 appends one line to the learner's own
record: the lab, the world size, PASS or FAIL, the first diagnosis and the time. Solutions and the
tests' runs are not recorded.

    make progress                    # your own table: every lab, its latest verdict
    make room                        # a workshop hub's instructor: learners x labs, redrawn live

Where the record lives: `$RINGSIDE_PROGRESS/<login>.jsonl` when the variable names a folder (a
workshop hub sets it to a drop folder that learners can write to but not list, so each learner's
file is readable by its owner and by the instructor only), else `~/.ringside/progress/`.
The learner a record belongs to is the owner of its file, not its name.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import pwd
import sys
import time
from datetime import datetime
from pathlib import Path

FIELDS = ("time", "lab", "world_size", "verdict", "diagnosis")


def folder() -> Path:
    named = os.environ.get("RINGSIDE_PROGRESS", "").strip()
    return Path(named) if named else Path.home() / ".ringside" / "progress"


def record(lab: str, world_size: int, passed: bool, diagnosis: str = "") -> None:
    """Append this run's verdict to the learner's record. Never fails the lab: a record that cannot
    be written (a read-only home, a full disk) is skipped with one line on stderr."""
    line = {"time": datetime.now().isoformat(timespec="seconds"), "lab": lab, "world_size": world_size,
            "verdict": "PASS" if passed else "FAIL", "diagnosis": diagnosis.splitlines()[0][:200] if diagnosis else ""}
    try:
        where = folder()
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = where / f"{getpass.getuser()}.jsonl"
        # created readable by its owner only: in a shared drop folder no other learner can read it
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as out:
            out.write(json.dumps(line) + "\n")
    except OSError as error:
        print(f"(the verdict was not recorded for `make progress`: {error})", file=sys.stderr)


def owner(path: Path) -> str:
    try:
        return pwd.getpwuid(path.stat().st_uid).pw_name
    except KeyError:
        return str(path.stat().st_uid)


def latest(where: Path, only_mine: bool = False) -> dict[str, dict[str, dict]]:
    """learner -> lab -> the latest record of that lab, from every readable file in `where` (or the
    learner's own file only: a hub's drop folder cannot be listed by learners)."""
    table: dict[str, dict[str, dict]] = {}
    paths = [where / f"{getpass.getuser()}.jsonl"] if only_mine else sorted(where.glob("*.jsonl"))
    for path in [p for p in paths if p.exists()]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue  # another learner's file, read by a learner: not theirs to see
        learner = table.setdefault(owner(path), {})
        for text in lines:
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                continue  # a line cut short by a full disk
            learner[row["lab"]] = row
    return table


def render(table: dict[str, dict[str, dict]], details: bool) -> str:
    labs = sorted({lab for row in table.values() for lab in row})
    if not table:
        return "no lab run recorded yet"
    width = max(len(name) for name in table) + 2
    lines = [" " * width + " ".join(f"{lab:>9}" for lab in labs)]
    for learner, row in sorted(table.items()):
        cells = []
        for lab in labs:
            got = row.get(lab)
            cells.append(f"{(got['verdict'] + ' ' + str(got['world_size'])) if got else '.':>9}")
        lines.append(f"{learner:<{width}}" + " ".join(cells))
    if details:
        lines.append("")
        for learner, row in sorted(table.items()):
            for lab, got in sorted(row.items()):
                if got["verdict"] == "FAIL":
                    lines.append(f"{learner}, lab {lab} ({got['time'][11:]}, {got['world_size']} ranks): {got['diagnosis']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringside.progress", description=__doc__.split("\n")[0])
    parser.add_argument("--room", type=Path, help="a folder of every learner's record (the instructor's view)")
    parser.add_argument("--watch", type=float, default=0, help="redraw every so many seconds (Ctrl-C stops)")
    opts = parser.parse_args(argv)
    where = opts.room or folder()
    header = ("labs (PASS/FAIL and the world size of each lab's latest run; . = not run yet), "
              f"from {where}")
    while True:
        text = f"{header}\n\n{render(latest(where, only_mine=opts.room is None), details=True)}"
        if not opts.watch:
            print(text)
            return 0
        print("\033[2J\033[H" + time.strftime("%H:%M:%S ") + text, flush=True)
        try:
            time.sleep(opts.watch)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
