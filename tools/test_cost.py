"""What each test costs in CPU-seconds (`make test-cost`): the suite on 2 cores is bound by CPU, not
by waiting, so this is the number a chapter's budget (docs/AUTHORING.md) is kept in.

    python -m tools.test_cost [--json FILE] [--check] -- PYTEST ARGS...

runs pytest (any arguments `make test` takes) with this module as a plugin, inside a cgroup of its
own. Every pytest process (the controller, each xdist worker) then moves itself into a child cgroup,
so the CPU time of a test is what its worker's cgroup used while it ran: the worker, the rank
starter it forked ranks from, every torchrun, rank, loader worker and Slurm job it started, whether
or not they were waited for. (getrusage's children time misses a process that outlives the test or
is never reaped, such as the rank starter.) At the end it prints the CPU-seconds by file and by
chapter (the first NN_ in a test's id: chapters/NN_x.ipynb, solutions/NN_x.py's tests and planted
mistakes; test_template.py and test_slurm.py count as "template"; the rest as "package"), each
beside its budget from docs/AUTHORING.md's table; --check exits 1 when one is over.

It needs a cgroup it may write: root, with cgroup v2 (or v1's cpuacct). Anything else: it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = "RINGSIDE_COST_CGROUP"  # the run's cgroup: set by the command for its pytest
OUT = "RINGSIDE_COST_OUT"  # a folder where each pytest process leaves its tests' costs


# --- cgroups -----------------------------------------------------------------------------------------


def _mounts() -> dict[str, str]:
    """{"v2": path, "v1": path of cpuacct}: the hierarchies this machine has mounted."""
    found = {}
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, kind, options = line.split()[:4]
        if kind == "cgroup2":
            found.setdefault("v2", point)
        elif kind == "cgroup" and "cpuacct" in options.split(","):
            found.setdefault("v1", point)
    return found


def _own_cgroup(root: str, version: str) -> Path:
    """This process's cgroup folder in that hierarchy (from /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == "v2" and controllers == "") or (version == "v1" and "cpuacct" in controllers.split(",")):
            return Path(root) / path.lstrip("/")
    return Path(root)


def usage_s(folder: Path) -> float:
    """CPU-seconds used by every process that was ever in `folder` or below it."""
    stat = folder / "cpu.stat"
    if stat.exists():
        return int(stat.read_text().split("usage_usec")[1].split()[0]) / 1e6
    return int((folder / "cpuacct.usage").read_text()) / 1e9


def make_cgroup(name: str) -> Path:
    """A new cgroup below this process's own; raises OSError (with why) where none can be made."""
    mounts = _mounts()
    version = "v2" if "v2" in mounts else "v1" if "v1" in mounts else None
    if version is None:
        raise OSError("no cgroup v2 or cpuacct hierarchy is mounted")
    folder = _own_cgroup(mounts[version], version) / name
    folder.mkdir()
    return folder


def join(folder: Path, pid: int = 0) -> None:
    (folder / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")


def remove(folder: Path) -> None:
    """Remove a cgroup and the ones below it, killing what still runs there (a leftover process)."""
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [folder]:
        for pid in (sub / "cgroup.procs").read_text().split() if (sub / "cgroup.procs").exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(50):
            try:
                sub.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# --- The pytest plugin (-p tools.test_cost), active only under the command ----------------------------

_results: dict[str, tuple[float, float]] = {}  # nodeid -> (CPU-seconds, wall seconds)


def _enter() -> Path | None:
    """Under the command: this pytest process (the controller, or xdist worker gwN) moves into a
    cgroup of its own below the run's. At import (-p loads this module first), before conftest.py
    starts anything (a rank starter) that must count to this process's tests."""
    run = os.environ.get(ENV)
    if not run:
        return None
    mine = Path(run) / os.environ.get("PYTEST_XDIST_WORKER", "controller")
    mine.mkdir(exist_ok=True)
    join(mine)
    return mine


_mine = _enter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Time one test, setup and teardown included (a module fixture's run counts to the test that
    first needs it, as it costs there)."""
    if _mine is None:
        yield
        return
    cpu, wall = usage_s(_mine), time.monotonic()
    yield
    _results[item.nodeid] = (usage_s(_mine) - cpu, time.monotonic() - wall)


def pytest_sessionfinish(session):
    if _mine is not None and _results:
        Path(os.environ[OUT], f"{_mine.name}.json").write_text(json.dumps(_results))


# --- Grouping, budgets and the report ---------------------------------------------------------------

BUDGET_TABLE = ROOT / "docs" / "AUTHORING.md"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def chapter_of(nodeid: str) -> str:
    """"NN" for a chapter's notebook, solution, lab and planted mistakes; "template"; "package"."""
    path = file_of(nodeid)
    if path.endswith(("test_template.py", "test_slurm.py")) or "test_template" in path:
        return "template"
    found = re.search(r"(?<![0-9])(\d\d)_[a-z]", nodeid)
    return found.group(1) if found else "package"


def budgets(path: Path = BUDGET_TABLE) -> dict[str, float]:
    """The budget table of docs/AUTHORING.md: rows `| 04 ring_allreduce | ... | 40 |`, the budget
    in CPU-seconds in the last column, the chapter (or template, package) first."""
    table, inside = {}, False
    for line in path.read_text().splitlines():
        if line.startswith("| Part ") and "budget" in line.lower():
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip("|").split("|")]
            key = cells[0].split()[0] if cells[0] else ""
            if key and re.fullmatch(r"\d+", cells[-1].replace(",", "")):
                table[key] = float(cells[-1].replace(",", ""))
    return table


def report(results: dict[str, tuple[float, float]], total: float, wall: float, check: bool) -> int:
    by_file, by_chapter = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for nodeid, (cpu, _) in results.items():
        for table, key in ((by_file, file_of(nodeid)), (by_chapter, chapter_of(nodeid))):
            table[key][0] += cpu
            table[key][1] += 1
    counted = sum(cpu for cpu, _ in results.values())
    print(f"\nCPU-seconds by file ({len(results)} tests):")
    for name, (cpu, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        print(f"  {cpu:8.1f}  {n:5d} tests  {name}")
    limits = budgets()
    over = []
    print("\nCPU-seconds by chapter, against the budget in docs/AUTHORING.md:")
    for name, (cpu, n) in sorted(by_chapter.items()):
        limit = limits.get(name)
        flag = "" if limit is None else f"  budget {limit:5.0f}" + ("  OVER" if cpu > limit else "")
        if limit is not None and cpu > limit:
            over.append(name)
        print(f"  {name:>8}  {cpu:8.1f}  {n:5d} tests{flag}")
    print(f"\nin tests {counted:.0f} CPU-s; the whole run {total:.0f} CPU-s (collection, start-up, "
          f"pytest itself: {total - counted:.0f}) in {wall:.0f} s wall")
    if limits:
        print(f"budget of the whole suite: {sum(limits.values()):.0f} CPU-s")
    if over:
        print(f"over budget: {', '.join(over)}")
    return 1 if (check and over) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write every test's (CPU-s, wall s) to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 when a chapter is over its budget")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    opts = parser.parse_args(argv)
    args = [a for a in opts.pytest_args if a != "--"] if opts.pytest_args[:1] == ["--"] else opts.pytest_args
    try:
        run = make_cgroup(f"ringside-cost-{os.getpid()}")
    except OSError as error:
        print(f"test_cost: needs a cgroup it can make (root, cgroup v2 or cpuacct): {error}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="test-cost-") as out:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "tools.test_cost", *args],
                                    env=dict(os.environ, **{ENV: str(run), OUT: out}), preexec_fn=lambda: join(run))
            status = proc.wait()
            wall, total = time.monotonic() - start, usage_s(run)
        finally:
            remove(run)
        results = {}
        for part in Path(out).glob("*.json"):
            results.update(json.loads(part.read_text()))
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=0, sort_keys=True))
    verdict = report(results, total, wall, opts.check)
    return status or verdict


if __name__ == "__main__":
    sys.exit(main())
