"""Chapter 17's measurement: DDP, local SGD and DiLoCo trained on the same model and data over slow links.

On HOSTS hosts of the simulated cluster (tools/cluster.py: network namespaces, tc-limited links), one
process per host, gloo, one thread per rank, each method trains the same MLP on the digits (every rank
its own slice of every global batch, AdamW inside) for the same number of steps:

    ddp             DDP: the gradients all-reduced at every step
    ddp_bf16        DDP with chapter 12's bf16_compress_hook: the gradients sent in bf16 (half the bytes).
                    (Chapter 12's powerSGD_hook hung here at its first compressed step: its callbacks start and
                    wait for nested all-reduces on gloo's 2 worker threads, and this model's 2 buckets can leave
                    both waiting; with bucket_cap_mb=100, one bucket, it runs. Not measured.)
    local_sgd_h16   16 local steps, then the parameters averaged (outer lr 1, no momentum)
    diloco_hH       H local steps, then DiLoCo's outer Nesterov step on the averaged pseudo-gradient (lr 0.7,
                    momentum 0.5: the paper's 0.9 overshoots on a run this short, as diloco_h16_m0.9 shows)
    diloco_h16_m0.9 the same with the paper's outer momentum, 0.9
    diloco_h16_bf16 the same, the pseudo-gradient sent in bf16 (half the bytes)
    diloco_h16_overlap  the all-reduce started at the sync and waited for only at the next one: the
                    outer step lands H steps late, the local progress made meanwhile kept on top of it

Every EVAL steps the model the method would hand over (DDP's parameters, DiLoCo's anchor) is evaluated
on the held-out digits; the clock is paused meanwhile. Beside each point: the wall-clock time since the
start and the bytes this host's interface has sent.

    python -m tools.diloco_bench [--rates 100mbit,1gbit] [--hosts 4] [--steps 192]
    (root; writes assets/17_diloco/cluster.json)

It brings the cluster up for each rate, runs the job with tools.cluster.run_job and takes the cluster
down again. `--worker` is the part that torchrun runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

from ringside import finish, init_distributed  # noqa: E402
from ringside.data import digits_split  # noqa: E402
from tools.cluster_bench import interface_bytes, rate_bytes_per_s  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "assets" / "17_diloco" / "cluster.json"
METHODS = ("ddp", "ddp_bf16", "local_sgd_h16", "diloco_h4", "diloco_h16", "diloco_h64", "diloco_h16_m0.9",
           "diloco_h16_bf16", "diloco_h16_overlap")


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Outer:
    """DiLoCo's outer step (lab 17's solution, with a dtype to send in and an overlapped variant)."""

    def __init__(self, model, lr: float, momentum: float, dtype=torch.float32, overlap: bool = False):
        self.params = list(model.parameters())
        self.anchor = [p.detach().clone() for p in self.params]
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.lr, self.momentum, self.dtype, self.overlap = lr, momentum, dtype, overlap
        self.pending = None  # (flat, work, the parameters when it was sent) while an all-reduce is in flight
        # the overlapped all-reduce gets a group of its own: on the default group the next barrier waits for it
        # (gloo runs a group's collectives on 2 worker threads, and its barrier waits for all of them; NCCL runs
        # them in order), and it would hold one of the threads the training's own collectives use
        self.group = dist.new_group(backend="gloo") if overlap else None

    @torch.no_grad()
    def sync(self) -> None:
        if self.pending is not None:  # overlapped: the last round's outer step first
            self.finish()
        flat = torch.cat([(a - p).reshape(-1) for a, p in zip(self.anchor, self.params)]).to(self.dtype)
        if not self.overlap:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
            self.apply(flat)
            for p, a in zip(self.params, self.anchor):
                p.copy_(a)
            return
        sent = [p.detach().clone() for p in self.params]
        self.pending = (flat, dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True), sent)

    @torch.no_grad()
    def finish(self) -> None:
        """The overlapped all-reduce has arrived: the outer step, then the local progress made since on top."""
        flat, work, sent = self.pending
        work.wait()
        self.pending = None
        self.apply(flat)
        for p, a, s in zip(self.params, self.anchor, sent):
            p.copy_(a + (p - s))

    def apply(self, flat) -> None:
        deltas = flat.float().split([p.numel() for p in self.params])
        for a, b, g in zip(self.anchor, self.buffers, deltas):
            b.mul_(self.momentum).add_(g.view_as(b))
            a.sub_(g.view_as(a).add(b, alpha=self.momentum), alpha=self.lr)


def train(method: str, opts, me, train_set, test_set) -> list[dict]:
    model = make_model(opts.width)
    outer, h = None, 1
    if method.startswith("ddp"):
        model = DDP(model)
        if method == "ddp_bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        words = method.split("_")
        h = int(next(w[1:] for w in words if w.startswith("h")))
        local = method.startswith("local_sgd")
        momentum = next((float(w[1:]) for w in words if w.startswith("m")), opts.outer_momentum)  # diloco_h16_m0.5
        outer = Outer(model, 1.0 if local else opts.outer_lr, 0.0 if local else momentum,
                      torch.bfloat16 if "bf16" in words else torch.float32, "overlap" in words)
    inner = torch.optim.AdamW(model.parameters(), lr=opts.inner_lr)
    x, y = train_set.tensors
    tx, ty = test_set.tensors
    points, elapsed, sent0 = [], 0.0, interface_bytes()[0]

    def evaluate(step: int) -> None:
        weights = outer.anchor if outer is not None else [p.detach() for p in model.parameters()]
        probe = make_model(opts.width)
        with torch.no_grad():
            for p, w in zip(probe.parameters(), weights):
                p.copy_(w)
            loss = F.cross_entropy(probe(tx), ty).item()
        points.append({"step": step, "time_s": elapsed, "sent_bytes": interface_bytes()[0] - sent0, "test_loss": loss})

    dist.barrier()
    evaluate(0)
    for step in range(1, opts.steps + 1):
        start = time.perf_counter()
        i = ((step * me.world_size + me.rank) * opts.batch) % (len(y) - opts.batch)
        inner.zero_grad()
        F.cross_entropy(model(x[i:i + opts.batch]), y[i:i + opts.batch]).backward()
        inner.step()
        if outer is not None and step % h == 0:
            outer.sync()
        if step % opts.eval_every == 0:
            if outer is not None and outer.pending is not None and step == opts.steps:
                outer.finish()  # the last one lands before the end
            dist.barrier()  # the step ends when the slowest rank is done
            elapsed += time.perf_counter() - start
            evaluate(step)
        else:
            elapsed += time.perf_counter() - start
    return points


def worker(opts) -> None:
    me = init_distributed(timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    train_set, test_set = digits_split()
    load_before = os.getloadavg()
    methods = {}
    for method in opts.methods.split(","):
        points = train(method, opts, me, train_set, test_set)
        longest = torch.tensor([p["time_s"] for p in points], dtype=torch.float64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)  # the slowest host's clock
        for p, t in zip(points, longest.tolist()):
            p["time_s"] = t
        methods[method] = points
        if me.is_main:
            last = points[-1]
            print(f"{opts.rate} {method}: {last['time_s']:.1f} s, {last['sent_bytes'] / 2**20:.1f} MiB sent, "
                  f"test loss {last['test_loss']:.3f}", flush=True)
    if me.is_main:
        param_bytes = sum(p.numel() * 4 for p in make_model(opts.width).parameters())
        out = Path(opts.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result.update({
            "what": f"the same MLP trained on the digits by DDP, local SGD and DiLoCo on {me.world_size} hosts x 1 "
                    f"process, gloo, 1 thread per rank (tools/diloco_bench.py)",
            "hosts": me.world_size, "torch": torch.__version__.split("+")[0],
            "model": {"width": opts.width, "param_bytes": param_bytes},
            "steps": opts.steps, "batch_per_rank": opts.batch, "eval_every": opts.eval_every,
            "inner": {"optimizer": "AdamW", "lr": opts.inner_lr},
            "outer": {"lr": opts.outer_lr, "momentum": opts.outer_momentum, "nesterov": True},
            "machine": {"cpus": os.cpu_count(),
                        "note": "the hosts are network namespaces on one machine: the ranks share its cores"},
        })
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        old = result.get("rates", {}).get(opts.rate, {})  # --methods: measure some again, keep the others
        kept = [m for m in old.get("methods", {}) if m not in methods]
        methods = {m: methods.get(m, old.get("methods", {}).get(m)) for m in METHODS if m in methods or m in kept}
        result.setdefault("rates", {})[opts.rate] = {
            "link_bytes_per_s": rate_bytes_per_s(opts.rate), "methods": methods,
            "loadavg_before": old.get("loadavg_before", list(load_before)) if kept else list(load_before),
            "loadavg_after": list(os.getloadavg()), "measured_at": old.get("measured_at", now) if kept else now,
            "measured_again": {**(old.get("measured_again", {}) if kept else {}), **{m: now for m in methods
                                                                                   if m not in kept}} if kept else {}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        os.chmod(out, 0o644)  # written as root; read by anyone
    finish(0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.diloco_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit", help="each link's rate (tc syntax), one run per rate")
    parser.add_argument("--rate", default="1gbit", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--inner-lr", type=float, default=1e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.5)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--worker", action="store_true", help="(torchrun runs this on every host)")
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts)
        return 0
    from tools import cluster

    signal.signal(signal.SIGTERM, cluster._interrupt)  # `kill` takes the cluster down, as Ctrl-C does
    for rate in opts.rates.split(","):
        args = ["--worker", "--rate", rate, "--methods", opts.methods, "--steps", opts.steps, "--eval-every",
                opts.eval_every, "--batch", opts.batch, "--width", opts.width, "--inner-lr", opts.inner_lr,
                "--outer-lr", opts.outer_lr, "--outer-momentum", opts.outer_momentum, "--out", Path(opts.out).resolve()]
        if cluster.run_bench(__file__, opts.hosts, rate, args, "diloco bench", timeout=opts.timeout):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
