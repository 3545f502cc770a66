"""Chapter 16's measurement: a ZeRO-3 step with and without prefetching, on a slow network.

On 2 hosts of the simulated cluster (tools/cluster.py: network namespaces, tc-limited links), one
process per host, gloo, one thread per rank: a model of LAYERS Linear layers WIDTH x WIDTH, trained
with ZeRO-3 by hand as chapter 16's section 2 does it (each layer all-gathered for its forward and
again for its backward, its gradient reduce-scattered, SGD on the shards). Three kinds of step,
interleaved round by round so that the machine's changing load falls on all of them alike:

    no_prefetch   each all-gather starts when its layer is about to run
    prefetch      the next layer's all-gather starts (async_op=True) before this layer computes
    comm_only     the same collectives alone, one after the other (what communication costs)

A step counts as long as its slowest rank; beside its median time, the bytes its interface sent per
step. The bound of the collectives is 3 x (N-1)/N x parameter bytes / link rate.

    python -m tools.fsdp_bench [--rate 1gbit] [--rounds 20]   (root; writes assets/16_fsdp/cluster.json)

It brings the cluster up (as `make cluster-overlap` does), runs the job with tools.cluster.run_job
and takes the cluster down again. `--worker` is the part that torchrun runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

from ringside import finish, init_distributed  # noqa: E402
from tools.cluster_bench import interface_bytes, rate_bytes_per_s  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "assets" / "16_fsdp" / "cluster.json"
HOSTS = 2
MODES = ("no_prefetch", "prefetch", "comm_only")


class Zero3:
    """ZeRO-3 of a stack of Linear layers (ReLU between them), as chapter 16's section 2."""

    def __init__(self, width: int, layers: int, rank: int, n: int):
        torch.manual_seed(0)
        self.n, self.width, self.layers = n, width, layers
        numel = width * width + width
        self.size = -(-numel // n)
        self.numel = numel
        self.shards = []
        for _ in range(layers):
            flat = torch.randn(numel) / width ** 0.5
            flat = torch.cat([flat, flat.new_zeros(self.size * n - numel)])
            self.shards.append(flat[rank * self.size:(rank + 1) * self.size].clone())

    def gather(self, i: int):
        full = torch.empty(self.size * self.n)
        return full, dist.all_gather_into_tensor(full, self.shards[i], async_op=True)

    def weights(self, full):
        w, b = full[:self.numel].split([self.width * self.width, self.width])
        return w.view(self.width, self.width), b

    def step(self, x, prefetch: bool, lr: float = 1e-4) -> None:
        last, pending, inputs, h = self.layers - 1, {}, [], x
        for i in range(self.layers):
            full, work = pending.pop(i) if i in pending else self.gather(i)
            work.wait()
            if prefetch and i < last:
                pending[i + 1] = self.gather(i + 1)
            inputs.append(h)
            with torch.no_grad():
                h = F.linear(h, *self.weights(full))
                h = F.relu(h) if i < last else h
        h.requires_grad_()
        grad = torch.autograd.grad(h.pow(2).mean(), h)[0]
        for i in reversed(range(self.layers)):
            full, work = pending.pop(i) if i in pending else self.gather(i)
            work.wait()
            if prefetch and i > 0:
                pending[i - 1] = self.gather(i - 1)
            full.requires_grad_()
            inp = inputs[i].requires_grad_(i > 0)
            out = F.linear(inp, *self.weights(full))
            out = F.relu(out) if i < last else out
            grads = torch.autograd.grad(out, [full] + ([inp] if i > 0 else []), grad)
            grad = grads[-1]
            shard = torch.empty(self.size)
            dist.reduce_scatter_tensor(shard, grads[0], op=dist.ReduceOp.AVG)
            self.shards[i].add_(shard, alpha=-lr)

    def comm_only(self) -> None:
        for i in list(range(self.layers)) * 2:
            full, work = self.gather(i)
            work.wait()
        for i in range(self.layers):
            dist.reduce_scatter_tensor(torch.empty(self.size), torch.ones(self.size * self.n), op=dist.ReduceOp.AVG)


def worker(opts) -> None:
    me = init_distributed(timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    model = Zero3(opts.width, opts.layers, me.rank, me.world_size)
    x = torch.randn(opts.batch, opts.width)

    def run(mode: str) -> None:
        if mode == "comm_only":
            model.comm_only()
        else:
            model.step(x, prefetch=mode == "prefetch")

    for _ in range(opts.warmup):
        for mode in MODES:
            run(mode)
    times, sent = {m: [] for m in MODES}, {m: 0 for m in MODES}
    for _ in range(opts.rounds):
        for mode in MODES:
            dist.barrier()
            sent0, start = interface_bytes()[0], time.perf_counter()
            run(mode)
            times[mode].append(time.perf_counter() - start)
            dist.barrier()
            sent[mode] += interface_bytes()[0] - sent0
    slowest = {}
    for mode in MODES:
        t = torch.tensor(times[mode], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[mode] = t.tolist()
    if me.is_main:
        param_bytes = opts.layers * (opts.width * opts.width + opts.width) * 4
        link = rate_bytes_per_s(opts.rate)
        result = {
            "what": "one ZeRO-3 step by hand (chapter 16, section 2) on 2 hosts x 1 process, gloo, 1 thread per rank",
            "hosts": me.world_size, "rate": opts.rate, "link_bytes_per_s": link, "torch": torch.__version__.split("+")[0],
            "model": {"layers": opts.layers, "width": opts.width, "batch": opts.batch, "param_bytes": param_bytes},
            "rounds": opts.rounds, "warmup_rounds": opts.warmup,
            "collectives_bound_s": 3 * (me.world_size - 1) / me.world_size * param_bytes / link,
            "modes": {m: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                          "sent_bytes_per_step": sent[m] // opts.rounds, "raw_s": v} for m, v in slowest.items()},
            "machine": {"cpus": os.cpu_count(), "loadavg_before": list(load_before),
                        "loadavg_after": list(os.getloadavg()),
                        "note": "the hosts are network namespaces on one machine: both ranks share its cores"},
            "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        }
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        os.chmod(out, 0o644)  # written as root; read by anyone
        print(f"{result['hosts']} hosts, {opts.rate}: bound of the collectives "
              f"{result['collectives_bound_s'] * 1000:.0f} ms; " + ", ".join(
                  f"{m} {r['median_s'] * 1000:.0f} ms ({r['sent_bytes_per_step'] / 2**20:.1f} MiB sent)"
                  for m, r in result["modes"].items()) + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    finish(0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fsdp_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each link's rate (tc syntax)")
    parser.add_argument("--rounds", type=int, default=20, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
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
    return cluster.run_bench(__file__, HOSTS, opts.rate, args, "fsdp bench", timeout=opts.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
