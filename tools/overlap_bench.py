"""Chapter 12's measurement: how much of DDP's communication hides behind backward on a slow network.

On 2 hosts of the simulated cluster (tools/cluster.py: network namespaces, tc-limited links), one
process per host, gloo, one thread per rank, a model of 8 layers 1024x1024 (32 MiB of gradients)
and a batch of 512 (on one core a step's computation takes about as long as the all-reduce at
1 Gbit/s): one training step (forward, backward, SGD step) timed in five ways, interleaved round by
round so that the machine's changing load falls on all of them alike:

    per_layer     DDP, bucket_cap_mb=4: one bucket per layer, the all-reduces start during backward
    default       DDP with its defaults (a first bucket of 1 MiB, then 25 MiB buckets)
    one_bucket    DDP, bucket_cap_mb=64 (more than the model): one all-reduce, after the last gradient
    no_comm       the same step under no_sync(): backward alone, nothing sent
    all_reduce    dist.all_reduce of one tensor as large as all the gradients, alone

A step counts as long as its slowest rank; beside its time, the CPU time of the process (all its
threads: with the hosts sharing one machine's cores, what communication costs in CPU shows there)
and the bytes its interface sent. Hidden fraction of an overlapping run:
    (one_bucket - overlapping) / (one_bucket - no_comm)
the share of the communication that the step without overlap pays and the overlapping step does not
(1: all hidden, 0: none), with a 90% interval from resampling the rounds. The bound is
2(N-1)/N x gradient bytes / link rate. The load of the machine moves all of it: the file keeps a
summary of its earlier runs of the same setup under "earlier_runs".

    python -m tools.overlap_bench [--rate 1gbit] [--rounds 100]   (root; writes assets/cluster/overlap.json)

It brings the cluster up (taking the cluster lock, as `make cluster-bench` does), runs the job with
tools.cluster.run_job and takes the cluster down again. `--worker` is the part that torchrun runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

from ringside import finish, init_distributed  # noqa: E402
from ringside.ring import CLUSTER_DIR  # noqa: E402
from tools.cluster_bench import interface_bytes, rate_bytes_per_s  # noqa: E402

OUT = CLUSTER_DIR / "overlap.json"
HOSTS = 2
MODES = {
    "per_layer": "DDP, bucket_cap_mb=4: one bucket per layer",
    "default": "DDP defaults: first bucket 1 MiB, then 25 MiB",
    "one_bucket": "DDP, bucket_cap_mb=64: one bucket, larger than the model",
    "no_comm": "the same DDP step under no_sync(): no communication",
    "all_reduce": "dist.all_reduce of all the gradients' bytes, alone",
}
CAP_MB = {"per_layer": 4, "default": None, "one_bucket": 64, "no_comm": 64}


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def bucket_bytes(ddp) -> list[int]:
    """The sizes of DDP's buckets after its rebuild, in bytes, first bucket first (from DDP's own
    logging data: a private method, the one place that tells the sizes)."""
    sizes = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def traced_hook(trace: list):
    """DDP's default all-reduce as a comm hook that also notes, per bucket, when DDP handed it over
    (every gradient in it computed) and when its all-reduce finished, in perf_counter seconds."""
    def hook(state, bucket):
        ready = time.perf_counter()
        world = dist.get_world_size()
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def done(fut):
            trace.append((bucket.index(), ready, time.perf_counter()))
            return fut.value()[0].div_(world)
        return future.then(done)
    return hook


def schedule_bound(ready: list[float], comm: list[float], backward_end: float) -> float:
    """Communication left after backward (s) if the buckets' all-reduces ran one at a time, in bucket
    order, each starting when its bucket is ready and the one before has finished, each taking
    `comm` seconds: what no schedule of these buckets on one link can beat."""
    end = 0.0
    for r, c in zip(ready, comm):
        end = max(end, r) + c
    return max(0.0, end - backward_end)


def summary(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": min(values), "max": max(values)}


def worker(opts) -> None:
    me = init_distributed(timeout=timedelta(seconds=300))
    load_before = os.getloadavg()
    x = torch.randn(opts.batch, opts.width)
    ddps, optimizers = {}, {}
    for mode, cap in CAP_MB.items():
        model = make_model(opts.width, opts.layers)
        ddps[mode] = nn.parallel.DistributedDataParallel(model) if cap is None else \
            nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        optimizers[mode] = torch.optim.SGD(model.parameters(), lr=1e-4)
    grad_bytes = sum(p.numel() * p.element_size() for p in ddps["one_bucket"].parameters())
    flat = torch.ones(grad_bytes // 4)
    # per_layer's schedule, traced: the same buckets (bucket_cap_mb=4) with a hook that notes times
    traced_model = make_model(opts.width, opts.layers)
    traced = nn.parallel.DistributedDataParallel(traced_model, bucket_cap_mb=CAP_MB["per_layer"])
    trace: list = []
    traced.register_comm_hook(None, traced_hook(trace))
    traced_optimizer = torch.optim.SGD(traced_model.parameters(), lr=1e-4)

    def step(mode: str) -> tuple[float, float]:
        """One step; (seconds of the step, of which backward) on this rank."""
        if mode == "all_reduce":
            start = time.perf_counter()
            dist.all_reduce(flat)
            end = time.perf_counter()
            return end - start, end - start
        ddp, optimizer = ddps[mode], optimizers[mode]
        start = time.perf_counter()
        with ddp.no_sync() if mode == "no_comm" else nullcontext():
            loss = ddp(x).pow(2).mean()
            before_backward = time.perf_counter()
            loss.backward()  # under DDP: returns once every bucket's all-reduce is done
            after_backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start, after_backward - before_backward

    for _ in range(opts.warmup):  # connections, and DDP's bucket rebuild after its first iteration
        for mode in MODES:
            step(mode)
    def traced_step() -> dict:
        """per_layer's step with the hook: each bucket's ready and finish time after backward started,
        the backward's own end (the last bucket is ready when the last gradient is), and its size."""
        trace.clear()
        loss = traced(x).pow(2).mean()
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        traced_optimizer.step()
        traced_optimizer.zero_grad()
        rows = sorted(trace)
        return {"ready_s": [r - start for _, r, _ in rows], "done_s": [d - start for _, _, d in rows],
                "backward_s": end - start}

    one_bucket_flat = torch.ones(opts.width * opts.width + opts.width)
    for _ in range(opts.warmup):
        traced_step()
    times = {mode: [] for mode in MODES}
    backward = {mode: [] for mode in MODES}
    traces, bucket_alone = [], []
    cpu = {mode: [] for mode in MODES}  # CPU seconds of this process (all its threads) per step
    sent = {mode: 0 for mode in MODES}
    for _ in range(opts.rounds):
        for mode in MODES:
            dist.barrier()  # both ranks start the step together
            sent0, cpu0 = interface_bytes()[0], time.process_time()
            total, back = step(mode)
            cpu[mode].append(time.process_time() - cpu0)
            dist.barrier()  # everything sent has arrived before the counter is read
            sent[mode] += interface_bytes()[0] - sent0
            times[mode].append(total)
            backward[mode].append(back)
        dist.barrier()
        traces.append(traced_step())
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(one_bucket_flat)  # one layer's bucket, alone on the link
        bucket_alone.append(time.perf_counter() - start)
    # a step lasts as long as its slowest rank
    slowest = {}
    for mode in MODES:
        both = torch.tensor([times[mode], backward[mode], cpu[mode]], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        slowest[mode] = both.tolist()
    buckets = {mode: bucket_bytes(ddps[mode]) for mode in CAP_MB if mode != "no_comm"}
    all_traces = [None] * me.world_size
    dist.all_gather_object(all_traces, (traces, bucket_alone))
    if me.is_main:
        write(opts, me.world_size, grad_bytes, slowest, sent, buckets, load_before, all_traces)
    finish(0)


def overlap_bound(all_traces, link: float, hosts: int, grad_bytes: int, layers: int) -> dict:
    """per_layer's schedule, as traced on rank 0 (its backward is as long as the other's): the
    median over rounds of each bucket's ready time, the compute left after it, and the communication
    that must be left after backward, both at the link's bound and at the all-reduce time measured for
    one bucket alone; the hideable fraction each allows."""
    traces, alone = all_traces[0]
    n = len(traces[0]["ready_s"])
    ready = [statistics.median(t["ready_s"][k] for t in traces) for k in range(n)]
    done = [statistics.median(t["done_s"][k] for t in traces) for k in range(n)]
    backward_end = statistics.median(t["ready_s"][-1] for t in traces)  # the last gradient's moment
    per_bucket_bound = 2 * (hosts - 1) / hosts * grad_bytes / layers / link
    per_bucket_measured = statistics.median(alone)
    left = {"at_bound": schedule_bound(ready, [per_bucket_bound] * n, backward_end),
            "as_measured_alone": schedule_bound(ready, [per_bucket_measured] * n, backward_end)}
    total = {"at_bound": per_bucket_bound * n, "as_measured_alone": per_bucket_measured * n}
    return {"bucket_ready_s": ready, "bucket_done_s": done, "backward_compute_s": backward_end,
            "compute_after_ready_s": [backward_end - r for r in ready],
            "bucket_allreduce_alone_s": per_bucket_measured, "bucket_allreduce_bound_s": per_bucket_bound,
            "comm_left_after_backward_s": left,
            "hideable_fraction": {k: 1 - left[k] / total[k] for k in left},
            "definition": "buckets all-reduced one at a time in bucket order, each from its ready time; "
                          "hideable = 1 - (communication left after the last gradient) / (all communication)"}


def write(opts, hosts: int, grad_bytes: int, slowest: dict, sent: dict, buckets: dict, load_before,
          all_traces) -> None:
    link = rate_bytes_per_s(opts.rate)
    bound = 2 * (hosts - 1) / hosts * grad_bytes / link
    modes = {}
    for mode, description in MODES.items():
        step_s, backward_s, cpu_s = slowest[mode]
        modes[mode] = {"description": description, "step_s": summary(step_s), "backward_s": summary(backward_s),
                       "cpu_s": summary(cpu_s),
                       "sent_bytes_per_step": sent[mode] // opts.rounds, "buckets_bytes": buckets.get(mode),
                       "raw_step_s": step_s, "raw_backward_s": backward_s, "raw_cpu_s": cpu_s}
    hidden = hidden_fractions({mode: slowest[mode][0] for mode in MODES})
    interval = bootstrap({mode: slowest[mode][0] for mode in MODES})
    no_comm = modes["no_comm"]["step_s"]["median"]
    last_bucket = {mode: buckets[mode][-1] / grad_bytes for mode in ("per_layer", "default", "one_bucket")}
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result = {
        "what": "one training step (forward, backward, SGD step) on 2 hosts x 1 process, gloo, 1 thread per rank",
        "hosts": hosts, "procs_per_host": 1, "backend": "gloo", "torch": torch.__version__.split("+")[0],
        "rate": opts.rate, "link_bytes_per_s": link,
        "model": {"layers": opts.layers, "width": opts.width, "batch": opts.batch, "grad_bytes": grad_bytes},
        "rounds": opts.rounds, "warmup_rounds": opts.warmup,
        "allreduce_bound_s": bound,
        "hidden_fraction": hidden,
        "hidden_fraction_90pct_interval": interval,
        "hidden_fraction_definition": "(one_bucket - mode) / (one_bucket - no_comm), on the medians of the step time; "
                                      "the interval: 5th and 95th percentile over 2000 resamplings of the rounds",
        # what the step would take if the all-reduce ran at the bound: after backward (no overlap), or with
        # every bucket but the last (which starts after the last gradient) hidden completely
        "no_overlap_at_bound_s": no_comm + bound,
        "full_overlap_at_bound_s": {mode: no_comm + bound * f for mode, f in last_bucket.items()},
        "per_layer_schedule": overlap_bound(all_traces, link, hosts, grad_bytes, opts.layers),
        "modes": modes,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
                    "uptime_after": uptime,
                    "note": "the hosts are network namespaces on one machine: both ranks share its cores"},
        "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        result["earlier_runs"] = earlier_runs(json.loads(out.read_text()), result)
    out.write_text(json.dumps(result, indent=1) + "\n")
    os.chmod(out, 0o644)  # written as root; chapter 12 reads it as anyone
    print(report(result), flush=True)


SAME_SETUP = ("hosts", "rate", "model", "backend")


def earlier_runs(previous: dict, result: dict) -> list[dict]:
    """The file's earlier runs of the same setup, in short, oldest first: what the load changes."""
    if any(previous.get(key) != result[key] for key in SAME_SETUP):
        return []
    short = {key: previous[key] for key in ("measured_at", "rounds", "hidden_fraction", "hidden_fraction_90pct_interval",
                                             "allreduce_bound_s", "machine")}
    short["step_s"] = {mode: row["step_s"] for mode, row in previous["modes"].items()}
    short["cpu_s"] = {mode: row["cpu_s"] for mode, row in previous["modes"].items()}
    return previous.get("earlier_runs", []) + [short]


def hidden_fractions(steps: dict[str, list[float]]) -> dict[str, float]:
    """(one_bucket - mode) / (one_bucket - no_comm) on the median step times."""
    med = {mode: statistics.median(values) for mode, values in steps.items()}
    exposed = med["one_bucket"] - med["no_comm"]  # what communication adds to a step without overlap
    return {mode: (med["one_bucket"] - med[mode]) / exposed for mode in ("per_layer", "default")}


def bootstrap(steps: dict[str, list[float]], resamples: int = 2000) -> dict[str, list[float]]:
    """The hidden fractions' spread: recomputed on rounds drawn with replacement (a round's modes
    stay together: they ran one after the other, under the same load)."""
    rounds = len(steps["no_comm"])
    draw = torch.Generator().manual_seed(0)
    samples = {"per_layer": [], "default": []}
    for _ in range(resamples):
        pick = torch.randint(rounds, (rounds,), generator=draw).tolist()
        fractions = hidden_fractions({mode: [values[i] for i in pick] for mode, values in steps.items()})
        for mode, fraction in fractions.items():
            samples[mode].append(fraction)
    return {mode: [float(torch.tensor(v).quantile(0.05)), float(torch.tensor(v).quantile(0.95))] for mode, v in samples.items()}


def report(result: dict) -> str:
    lines = [f"{result['hosts']} hosts, {result['rate']} links, {result['model']['grad_bytes'] / 2**20:.0f} MiB of gradients, "
             f"{result['rounds']} rounds; all-reduce bound {result['allreduce_bound_s'] * 1000:.0f} ms"]
    for mode, row in result["modes"].items():
        s = row["step_s"]
        lines.append(f"  {mode:<11} step median {s['median'] * 1000:6.0f} ms  (quartiles {s['q1'] * 1000:5.0f}-"
                     f"{s['q3'] * 1000:5.0f}, backward {row['backward_s']['median'] * 1000:5.0f}, "
                     f"CPU {row['cpu_s']['median'] * 1000:4.0f})  "
                     f"sent {row['sent_bytes_per_step'] / 2**20:5.1f} MiB/step  buckets {row['buckets_bytes']}")
    lines.append("  hidden: " + ", ".join(f"{m} {f:.0%} (90% interval {lo:.0%} to {hi:.0%})" for (m, f), (lo, hi)
                                          in zip(result["hidden_fraction"].items(), result["hidden_fraction_90pct_interval"].values())))
    bound = result["per_layer_schedule"]
    lines.append("  per_layer schedule: buckets ready at " + ", ".join(f"{r * 1000:.0f}" for r in bound["bucket_ready_s"])
                 + f" ms of a {bound['backward_compute_s'] * 1000:.0f} ms backward; one bucket's all-reduce alone "
                 f"{bound['bucket_allreduce_alone_s'] * 1000:.0f} ms (bound {bound['bucket_allreduce_bound_s'] * 1000:.0f})")
    lines.append("  hideable by this schedule: " + ", ".join(f"{k} {v:.0%}" for k, v in bound["hideable_fraction"].items()))
    lines.append(f"  load: {result['machine']['uptime_after']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.overlap_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each link's rate (tc syntax)")
    parser.add_argument("--rounds", type=int, default=100, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help="(torchrun runs this on every host)")
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts)
        return 0
    from tools import cluster

    signal.signal(signal.SIGTERM, cluster._interrupt)  # `kill` takes the cluster down, as Ctrl-C does
    args = ["--worker", "--rate", opts.rate, "--rounds", opts.rounds, "--warmup", opts.warmup, "--layers", opts.layers,
            "--width", opts.width, "--batch", opts.batch, "--out", Path(opts.out).resolve()]
    return cluster.run_bench(__file__, HOSTS, opts.rate, args, "overlap bench", timeout=opts.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
