"""`make bench`: time three all-reduces on 2 and 4 ranks for sizes from 4 KiB to 64 MiB.

    naive       ringside.ring.naive_all_reduce: everything to rank 0, the sum back to everyone
    ring        ring_all_reduce from solutions/04_ring_allreduce.py (the lab's answer)
    all_reduce  torch.distributed.all_reduce (gloo on the CPU)

Writes assets/bench/allreduce.json (every measurement) and assets/bench/allreduce.png (time and
bus bandwidth vs size), which chapter 04 reads. The ranks are forked on this machine (gloo over
loopback), so "links" are memory copies that share the same cores: read the result with that in mind.

Usage: python -m tools.bench [--quick]   (--quick: fewer sizes and repetitions, for a smoke test)
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ringside import run_ranks
from ringside.ring import BENCH_JSON, METHODS, ROOT, human_bytes, naive_all_reduce

BENCH_DIR, BENCH_PNG = BENCH_JSON.parent, BENCH_JSON.with_suffix(".png")
KiB, MiB = 1024, 1024 * 1024
SIZES = [4 * KiB * 4**k for k in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB
WORLD_SIZES = (2, 4)
SOLUTION = ROOT / "solutions" / "04_ring_allreduce.py"


def bus_bandwidth(n: int, size: float, seconds: float) -> float:
    """Bytes per second on each rank's link, comparable across rank counts (nccl-tests' busbw):
    (S / t) * 2(N-1)/N."""
    return size / seconds * 2 * (n - 1) / n


def load_ring_module():
    """The chapter's solution as a module (one implementation, not a copy); each call a new one."""
    spec = importlib.util.spec_from_file_location("ring_solution", SOLUTION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_ring():
    """ring_all_reduce from the chapter's solution."""
    return load_ring_module().ring_all_reduce


def repetitions(size: int, quick: bool) -> int:
    """Enough repetitions for a stable median, fewer for the slow large sizes."""
    if quick:
        return 3
    return 20 if size <= 1 * MiB else (12 if size <= 16 * MiB else 10)


def time_rank(rank: int, world_size: int, sizes: list[int], quick: bool) -> list[dict]:
    """Runs on every rank: for each size, repetitions of the three methods, interleaved so that
    a slow moment of the machine hits all three alike. A repetition's time is the slowest rank's;
    a size's time is the best repetition (other processes on the machine only ever add time).
    The CPU time that a rank spent (all its threads: copies, sums, system calls) is kept too: it
    does not include waiting, so it hardly depends on what else runs on the machine."""
    ring_all_reduce = load_ring()
    methods = {"naive": naive_all_reduce, "ring": ring_all_reduce, "all_reduce": dist.all_reduce}
    rows = []
    for size in sizes:
        tensor = torch.empty(size // 4, dtype=torch.float32)
        wall: dict[str, list[float]] = {name: [] for name in methods}
        cpu: dict[str, list[float]] = {name: [] for name in methods}
        for rep in range(repetitions(size, quick) + 1):  # the first is a warm-up
            for name, all_reduce in methods.items():
                tensor.fill_(1.0)  # the same input every time (repeated sums would overflow)
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                all_reduce(tensor)
                elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                if rep:
                    wall[name].append(elapsed)
                    cpu[name].append(elapsed_cpu)
                if tensor[0].item() != world_size:
                    raise RuntimeError(f"{name} gave {tensor[0].item()} instead of {world_size}")
        slowest = torch.tensor([[wall[name], cpu[name]] for name in methods], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        for name, (times, cpu_times) in zip(methods, slowest.tolist()):
            rows.append({"method": name, "ranks": world_size, "bytes": size, "seconds": min(times),
                         "median_seconds": statistics.median(times), "cpu_seconds": min(cpu_times),
                         "repetitions": len(times)})
    return rows


def run(quick: bool = False) -> dict:
    sizes = SIZES[::3] if quick else SIZES
    load_before = os.getloadavg()[0]  # how busy the machine was before the bench added its ranks
    rows = []
    for world_size in WORLD_SIZES:
        start = time.perf_counter()
        rows += run_ranks(time_rank, world_size, sizes, quick, timeout=300, show_output=False)[0]
        print(f"{world_size} ranks: {time.perf_counter() - start:.1f} s", flush=True)
    for row in rows:
        row["bus_bandwidth_GBps"] = bus_bandwidth(row["ranks"], row["bytes"], row["seconds"]) / 1e9
    return {
        "what": "time of one all-reduce of float32 tensors: the slowest rank's, best of the repetitions "
                "(the least disturbed by other processes; the median is kept too), ranks forked on one "
                "machine, gloo over loopback",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "load_average_1min_before": round(load_before, 2)},
        "methods": list(METHODS),
        "rows": rows,
    }


def headline(results: dict) -> dict:
    """ring / all_reduce at the largest size on the most ranks (the issue's 1.25x target)."""
    rows = results["rows"]
    ranks, size = max(r["ranks"] for r in rows), max(r["bytes"] for r in rows)
    t = {r["method"]: r["seconds"] for r in rows if r["ranks"] == ranks and r["bytes"] == size}
    cpu = {r["method"]: r["cpu_seconds"] for r in rows if r["ranks"] == ranks and r["bytes"] == size}
    return {"ranks": ranks, "bytes": size, "ring_over_all_reduce": t["ring"] / t["all_reduce"],
            "naive_over_all_reduce": t["naive"] / t["all_reduce"],
            "ring_over_all_reduce_cpu": cpu["ring"] / cpu["all_reduce"]}


def plot(results: dict, path=BENCH_PNG) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    colors = {"naive": "tab:red", "ring": "tab:blue", "all_reduce": "tab:green"}
    styles = {2: "--", 4: "-"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in METHODS:
        for ranks in sorted({r["ranks"] for r in rows}):
            picked = sorted((r for r in rows if r["method"] == method and r["ranks"] == ranks),
                            key=lambda r: r["bytes"])
            sizes = [r["bytes"] for r in picked]
            label = f"{method}, {ranks} ranks"
            left.plot(sizes, [r["seconds"] * 1e3 for r in picked], styles[ranks], marker="o",
                      color=colors[method], label=label, markersize=4)
            right.plot(sizes, [r["bus_bandwidth_GBps"] for r in picked], styles[ranks], marker="o",
                       color=colors[method], label=label, markersize=4)
    ticks = sorted({r["bytes"] for r in rows})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [human_bytes(s) for s in ticks], rotation=45)
        ax.set_xlabel("tensor size")
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("time per all-reduce (ms)")
    left.set_title("time vs size")
    right.set_ylabel("bus bandwidth (GB/s) = size/time x 2(N-1)/N")
    right.set_title("bus bandwidth vs size")
    right.legend(fontsize=8)
    fig.suptitle(f"all-reduce on one machine ({results['machine']['cpus']} CPUs, gloo over loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    results = run(quick="--quick" in argv)
    results["headline"] = headline(results)
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    BENCH_JSON.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)
    h = results["headline"]
    print(f"{h['ranks']} ranks, {human_bytes(h['bytes'])}: ring / all_reduce = {h['ring_over_all_reduce']:.2f}, "
          f"naive / all_reduce = {h['naive_over_all_reduce']:.2f}; CPU time ring / all_reduce = "
          f"{h['ring_over_all_reduce_cpu']:.2f} (load average before: {results['machine']['load_average_1min_before']})")
    print(f"wrote {BENCH_JSON.relative_to(ROOT)} and {BENCH_PNG.relative_to(ROOT)} "
          f"in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
