"""`make bench-verdicts`: how long a learner waits for a lab's verdict.

Times `python -m ringside N solutions/NN_*.py` (what `make solution` and `make lab` run) from start to
exit for every solution at 2 and 4 ranks (a solution that refuses a size is timed at the nearest it
accepts), REPEATS times each, and prints each lab's median, the median over labs and the slowest.
Run it on an idle machine: the ranks share its cores with anything else running.

Usage: python -m tools.verdict_bench [--repeats 3] [--ranks 2 4] [NN ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from ringside.launch import ROOT


def time_verdict(solution, nproc: int) -> tuple[float, bool]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ringside", str(nproc), str(solution)], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=600)
    return time.monotonic() - start, result.returncode == 0 and "PASS" in result.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("labs", nargs="*", help="chapter numbers (default: every lab)")
    args = parser.parse_args()
    solutions = sorted(p for p in (ROOT / "solutions").glob("[0-9][0-9]_*.py") if not args.labs or p.name[:2] in args.labs)
    medians: dict[int, list[tuple[float, str]]] = {n: [] for n in args.ranks}
    print(f"{'lab':<20}" + "".join(f"{n} ranks (s)".rjust(16) for n in args.ranks), flush=True)
    for solution in solutions:
        row = []
        for nproc in args.ranks:
            times, ok = [], True
            for _ in range(args.repeats):
                seconds, passed = time_verdict(solution, nproc)
                times.append(seconds)
                ok = ok and passed
            median = statistics.median(times)
            medians[nproc].append((median, solution.stem))
            row.append(f"{median:.1f}{'' if ok else ' (no PASS)'}".rjust(16))
        print(f"{solution.stem:<20}" + "".join(row), flush=True)
    for nproc in args.ranks:
        values = medians[nproc]
        slowest = max(values)
        print(f"{nproc} ranks: median over labs {statistics.median(v for v, _ in values):.1f} s, "
              f"slowest {slowest[1]} {slowest[0]:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
