"""All-reduce on the simulated cluster: naive vs ring vs dist.all_reduce, with a byte counter.

Runs on every host, one rank each, under `python -m tools.cluster run` (or `make cluster-bench`):

    python -m tools.cluster run --hosts 4 tools/cluster_bench.py --rate 1gbit --out FILE.json

Each rank times every method on the same tensor (a repetition counts as long as its slowest rank)
and reads its interface's own counters (/sys/class/net/eth0/statistics) before and after, so the
bytes each host really sent and received are measured, not assumed. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

from ringside import finish, init_distributed  # noqa: E402
from ringside.ring import SCATTER_REDUCE, naive_all_reduce, ring_schedule  # noqa: E402
from tools.bench import load_ring, load_ring_module  # noqa: E402

MiB = 1024 * 1024


def interface_bytes(name: str = "eth0") -> tuple[int, int]:
    """(bytes sent, bytes received) so far by this host's network interface."""
    stats = Path("/sys/class/net") / name / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def rate_bytes_per_s(rate: str) -> float:
    """tc's rate syntax (1gbit, 100mbit, 500kbit) in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"unknown rate {rate!r}")


def send_first_ring():
    """The lab's ring whose exchange posts its send before its receive: the order the solution had
    until this bench found that it makes a 2-host ring on gloo take about 1.5x as long (there the left
    and the right neighbour are one peer). The same messages and bytes; only the order in the batch differs."""
    module = load_ring_module()

    def send_right_receive_left(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
        rank, n = dist.get_rank(), dist.get_world_size()
        ops = [dist.P2POp(dist.isend, outgoing, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    module.send_right_receive_left = send_right_receive_left  # what ring_all_reduce calls
    return module.ring_all_reduce


def pipelined_ring_all_reduce(tensor: torch.Tensor, segments: int = 8) -> torch.Tensor:
    """The lab's ring, with each chunk cut into `segments` pieces that move independently.

    In the plain ring a rank sends step s+1's chunk only once all of step s's chunk has arrived,
    so every step pays a round trip and an addition while its link idles. Here piece j of step s+1
    leaves as soon as piece j of step s has arrived (and been added): the link stays busy. This is
    what gloo's own all_reduce does with its segments."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = [c.tensor_split(segments) for c in tensor.view(-1).tensor_split(n)]
    # the ring's one schedule (ringside.ring): at each step, which chunk this rank sends and receives
    schedule = [("add" if step.phase == SCATTER_REDUCE else "copy", step.sends[rank], step.receives(rank))
                for step in ring_schedule(n)]
    sends, arriving = [], None  # arriving: (receive requests, landing buffers, how, chunk) of the step before
    for how, send_chunk, receive_chunk in schedule:
        landing = [torch.empty_like(piece) for piece in chunks[receive_chunk]] if how == "add" else list(chunks[receive_chunk])
        receives = [dist.irecv(buf, src=left, tag=j) for j, buf in enumerate(landing)]
        for j in range(segments):
            if arriving is not None:  # piece j of what we send now is piece j that just arrived
                requests, buffers, before, chunk = arriving
                requests[j].wait()
                if before == "add":
                    chunks[chunk][j].add_(buffers[j])
            sends.append(dist.isend(chunks[send_chunk][j], dst=right, tag=j))
        arriving = (receives, landing, how, receive_chunk)
    for request in arriving[0]:
        request.wait()
    for request in sends:
        request.wait()
    return tensor


def time_methods(methods: dict, tensor: torch.Tensor, rounds: int) -> dict[str, dict]:
    """Every method timed once per round, in turn, for `rounds` rounds: interleaved, so that the
    machine's changing load falls on all of them alike. A call counts as long as its slowest rank.
    Per method: every round's seconds, and the bytes this host sent and received per call."""
    for fn in methods.values():
        fn(tensor.fill_(1.0))  # warm-up: connections and buffers
    times = {name: [] for name in methods}
    traffic = {name: [0, 0] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            tensor.fill_(1.0)
            # A call returns once its data is handed to the kernel, not once it has left the
            # interface: the barrier after it (every rank has received everything) settles that.
            dist.barrier()
            sent0, received0 = interface_bytes()
            start = time.perf_counter()
            fn(tensor)
            times[name].append(time.perf_counter() - start)
            dist.barrier()
            sent1, received1 = interface_bytes()
            traffic[name][0] += sent1 - sent0
            traffic[name][1] += received1 - received0
    out = {}
    for name in methods:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        # the barrier's own few bytes are counted too: under 1 KiB a call, against MiBs
        out[name] = {"seconds": slowest.tolist(), "sent": traffic[name][0] // rounds,
                     "received": traffic[name][1] // rounds}
    return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", default="1,4,16,64", help="comma-separated tensor sizes in MiB")
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds (every method once a round)")
    parser.add_argument("--rate", default="1gbit", help="the links' rate, as given to `make cluster`")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    me = init_distributed(timeout=timedelta(seconds=120))
    methods = {"naive": naive_all_reduce, "ring": load_ring(), "ring_pipelined": pipelined_ring_all_reduce,
               "all_reduce": dist.all_reduce}
    if me.world_size == 2:  # where the left and the right neighbour are one peer
        methods["ring_send_first"] = send_first_ring()
    rows = []
    for size_mib in [float(s) for s in opts.sizes_mib.split(",")]:
        tensor = torch.empty(int(size_mib * MiB) // 4, dtype=torch.float32)
        measured = time_methods(methods, tensor, opts.reps)
        for name, m in measured.items():
            per_host = [None] * me.world_size
            dist.all_gather_object(per_host, (m["sent"], m["received"]))
            q1, median, q3 = quartiles(m["seconds"])
            rows.append({"method": name, "bytes": tensor.numel() * 4, "seconds": median, "best_seconds": min(m["seconds"]),
                         "q1_seconds": q1, "q3_seconds": q3, "round_seconds": m["seconds"],
                         "sent_per_host": [t[0] for t in per_host], "received_per_host": [t[1] for t in per_host]})
            if me.is_main:
                ratio = median / statistics.median(measured["all_reduce"]["seconds"])
                print(f"{size_mib:>6g} MiB  {name:<14} median {median * 1000:8.1f} ms (q1 {q1 * 1000:7.1f}, q3 {q3 * 1000:7.1f})"
                      f"  {ratio:5.2f}x all_reduce  host 0 sent {m['sent'] / MiB:6.1f} MiB", flush=True)
    if me.is_main:
        result = {"hosts": me.world_size, "rate": opts.rate, "link_bytes_per_s": rate_bytes_per_s(opts.rate),
                  "rounds": opts.reps, "interleaved": True, "rows": rows}
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result, indent=1))
    finish(0)


if __name__ == "__main__":
    main()
