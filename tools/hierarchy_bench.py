"""Chapter 15's measurement: two kinds of link, the flat ring vs the hierarchical all-reduce, and
training steps of DDP, FSDP and HSDP, on the simulated cluster with 2 ranks per host.

On 2 and then 4 hosts of tools/cluster.py (network namespaces, each host's link limited with tc to
RATE each way), two processes per host, gloo, one thread each. Inside a host the two ranks talk over
the host's loopback (unshaped: the fast link); between hosts over the shaped link (the slow one).

    links       ping-pong between two ranks of one host and two ranks of two hosts (one-way time =
                round trip / 2), and the inter-host pair run by both local ranks at once (they share
                their host's link)
    allreduce   dist.all_reduce over all ranks (gloo's ring: the "flat" ring), the hierarchical
                all-reduce of lab 15 (solutions/15_hierarchy.py), each of its three phases alone, and
                the reduce-scatter and all-gather over all ranks that FSDP uses
    steps       one training step of a 4-layer MLP at each --widths (8, 16 and 32 MiB of fp32
                parameters by default): no communication (DDP under no_sync), DDP (4 MiB buckets),
                DDP with the hierarchical hook, FSDP2 over all ranks, HSDP (FSDP2 on a 2-D mesh:
                replicate across hosts, shard inside)

Every time is the slowest rank's; beside it the bytes each host's interface sent, from its own
counters. Rank 0 of each job writes a part; the driver merges them into assets/15_hierarchy/cluster.json.

    python -m tools.hierarchy_bench [--rate 1gbit]     (root; make cluster-hierarchy)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import signal
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

from ringside import finish, init_distributed  # noqa: E402
from ringside.launch import ROOT  # noqa: E402
from tools.cluster_bench import interface_bytes, rate_bytes_per_s  # noqa: E402

OUT = ROOT / "assets" / "15_hierarchy" / "cluster.json"
MiB = 2 ** 20
PER_HOST = 2
HOST_COUNTS = (2, 4)


def load_lab():
    """The finished lab (solutions/15_hierarchy.py): host_layout, make_groups, hierarchical_all_reduce."""
    path = ROOT / "solutions" / "15_hierarchy.py"
    spec = importlib.util.spec_from_file_location("hierarchy_solution", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slowest(seconds: list[float]) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def host_bytes_sent(before: int) -> list[int]:
    """Bytes each host's interface sent since `before` (read on local rank 0 of every host)."""
    sent = interface_bytes()[0] - before
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, sent)
    return rows[::PER_HOST]


def ping_pong(pairs: list[tuple[int, int]], nbytes: int, reps: int) -> float:
    """Median one-way time (round trip / 2) of `nbytes` between each pair at once; others idle."""
    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4)
    times = []
    for rep in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        for a, b in pairs:
            if rank == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            elif rank == b:
                dist.recv(buf, a)
                dist.send(buf, a)
        if rep:
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(slowest(times if times else [0.0]))


def timed(fn, reps: int) -> tuple[float, list[int]]:
    """Median time of fn() over reps (slowest rank), and the bytes each host sent per call."""
    fn()
    dist.barrier()
    before = interface_bytes()[0]
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    dist.barrier()
    sent = host_bytes_sent(before)
    return statistics.median(slowest(times)), [s // reps for s in sent]


def mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def worker(opts) -> None:
    me = init_distributed(timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    lab = load_lab()
    world, hosts = me.world_size, me.world_size // PER_HOST
    host_group, peer_group = lab.make_groups(world, PER_HOST)
    result = {"hosts": hosts, "ranks_per_host": PER_HOST, "links": [], "allreduce": [], "sizes": []}
    say = print if me.is_main else (lambda *a, **k: None)

    # --- links
    for nbytes in [int(s * MiB) for s in (0.0625, 0.25, 1, 4, 16)]:
        for link, pairs in (("intra", [(0, 1)]), ("inter", [(0, PER_HOST)]),
                            ("inter_shared", [(0, PER_HOST), (1, PER_HOST + 1)])):
            if link == "inter_shared" and nbytes < MiB:
                continue
            seconds = ping_pong(pairs, nbytes, opts.reps)
            result["links"].append({"link": link, "bytes": nbytes, "seconds": seconds})
            say(f"link {link:<12} {nbytes / MiB:7.4f} MiB one way {seconds * 1000:8.2f} ms", flush=True)

    # --- all-reduce
    for size_mib in (1, 4, 16):
        tensor = torch.ones(size_mib * MiB // 4)
        shard = torch.ones(tensor.numel() // PER_HOST)
        world_shard = torch.ones(tensor.numel() // world)
        methods = {
            "flat": lambda: dist.all_reduce(tensor),
            "hierarchical": lambda: lab.hierarchical_all_reduce(tensor, host_group, peer_group),
            "phase_reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, tensor, group=host_group),
            "phase_all_reduce": lambda: dist.all_reduce(shard, group=peer_group),
            "phase_all_gather": lambda: dist.all_gather_into_tensor(tensor, shard, group=host_group),
            "world_reduce_scatter": lambda: dist.reduce_scatter_tensor(world_shard, tensor),
            "world_all_gather": lambda: dist.all_gather_into_tensor(tensor, world_shard),
        }
        for name, fn in methods.items():
            seconds, sent = timed(fn, opts.reps)
            result["allreduce"].append({"method": name, "bytes": tensor.numel() * 4, "seconds": seconds,
                                        "sent_per_host": sent})
            say(f"allreduce {size_mib:3d} MiB {name:<22} {seconds * 1000:8.1f} ms, host 0 sent "
                f"{sent[0] / MiB:6.1f} MiB", flush=True)

    # --- training steps
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp_model(hook: bool):
        model = DDP(mlp(width, opts.layers), bucket_cap_mb=4)
        if hook:
            model.register_comm_hook((host_group, peer_group), lab.hierarchical_hook)
        return model

    def sharded(mesh):
        model = mlp(width, opts.layers)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    flat_mesh = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (hosts, PER_HOST), mesh_dim_names=("replicate", "shard"))
    makers = {
        "no_comm": lambda: ddp_model(False),
        "ddp": lambda: ddp_model(False),
        "ddp_hierarchical": lambda: ddp_model(True),
        "fsdp": lambda: sharded(flat_mesh),
        "hsdp": lambda: sharded(mesh_2d),
    }
    for width in [int(w) for w in opts.widths.split(",")]:
        x = torch.randn(opts.batch, width)
        model_info = {"width": width, "layers": opts.layers, "batch": opts.batch,
                      "param_bytes": sum(p.numel() * 4 for p in mlp(width, opts.layers).parameters())}
        steps = {}
        for name, make in makers.items():
            try:
                model = make()
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

                def step(model=model, optimizer=optimizer, name=name):
                    with model.no_sync() if name == "no_comm" else nullcontext():
                        optimizer.zero_grad()
                        model(x).pow(2).mean().backward()
                    optimizer.step()

                seconds, sent = timed(step, opts.steps)
                steps[name] = {"seconds": seconds, "sent_per_host": sent}
                say(f"step {model_info['param_bytes'] / MiB:4.0f} MiB {name:<18} {seconds * 1000:8.1f} ms, "
                    f"host 0 sent {sent[0] / MiB:6.1f} MiB", flush=True)
                del model, optimizer
            except Exception as error:  # one mode failing must not lose the others
                steps[name] = {"error": f"{type(error).__name__}: {error}"}
                say(f"step {name}: {error}", flush=True)
        result["sizes"].append({"model": model_info, "steps": steps})
    if me.is_main:
        Path(opts.part).write_text(json.dumps(result, indent=1))
    finish(0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hierarchy_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each host's link rate, each way (tc syntax)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--widths", default="724,1024,1448", help="MLP widths (8, 16, 32 MiB of parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hosts", default=",".join(map(str, HOST_COUNTS)))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--part", help="(the worker's output file)")
    parser.add_argument("--worker", action="store_true", help="(torchrun runs this on every host)")
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts)
        return 0
    from tools import cluster

    signal.signal(signal.SIGTERM, cluster._interrupt)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    merged = {"measured": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "rate": opts.rate,
              "link_bytes_per_s": rate_bytes_per_s(opts.rate), "torch": torch.__version__, "backend": "gloo",
              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores shared by all ranks",
              "ranks_per_host": PER_HOST, "reps": opts.reps, "runs": {}}
    for hosts in [int(h) for h in opts.hosts.split(",")]:
        part = Path(opts.out).with_name(f".part_{hosts}.json")
        args = ["--worker", "--rate", opts.rate, "--reps", opts.reps, "--steps", opts.steps, "--widths", opts.widths,
                "--layers", opts.layers, "--batch", opts.batch, "--part", part.resolve()]
        print(f"-- {hosts} hosts x {PER_HOST} ranks, {opts.rate} links", flush=True)
        if cluster.run_bench(__file__, hosts, opts.rate, args, "hierarchy bench", nproc_per_host=PER_HOST):
            return 1
        merged["runs"][str(hosts)] = json.loads(part.read_text())
        part.unlink()
    Path(opts.out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {Path(opts.out).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
