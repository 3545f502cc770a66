"""Chapter 04's shared code: the ring's schedule, its pictures, the naive all-reduce, and the
cost model fitted to the measurements (`make bench` on one machine, `make cluster-bench` on the
namespace cluster; both write JSON under assets/ that this module reads without root).

The ring all-reduce on N ranks splits the tensor into N chunks and runs 2(N-1) steps; at every
step each rank sends one chunk to its right neighbour (rank + 1) and receives one from its left:

    scatter-reduce step s (s = 0 .. N-2): rank r sends chunk (r - s) % N; the receiver ADDS it
    all-gather     step s (s = 0 .. N-2): rank r sends chunk (r + 1 - s) % N; the receiver COPIES it

After the scatter-reduce, rank r holds the full sum of chunk (r + 1) % N; after the all-gather,
every rank holds every summed chunk. The distributed version is the lab (solutions/04_*.py);
here the same schedule drives a single-process simulation and the step-through pictures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .launch import ROOT

BENCH_JSON = ROOT / "assets" / "bench" / "allreduce.json"  # written by `make bench` (tools/bench.py)
CLUSTER_DIR = ROOT / "assets" / "cluster"  # written by `make cluster-bench` and `make cluster-overlap`
MiB = 1024 * 1024

SCATTER_REDUCE, ALL_GATHER = "scatter-reduce", "all-gather"


# --- The schedule ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of the ring: every rank sends chunk `sends[r]` to rank (r + 1) % N."""

    phase: str  # SCATTER_REDUCE or ALL_GATHER
    index: int  # 0 .. N-2 within its phase
    sends: tuple[int, ...]  # sends[r]: the chunk that rank r sends to its right neighbour

    def receives(self, rank: int) -> int:
        """The chunk that `rank` receives from its left neighbour at this step."""
        return self.sends[(rank - 1) % len(self.sends)]


def ring_schedule(n: int) -> list[Step]:
    """The 2(N-1) steps of a ring all-reduce on n ranks."""
    scatter = [Step(SCATTER_REDUCE, s, tuple((r - s) % n for r in range(n))) for s in range(n - 1)]
    gather = [Step(ALL_GATHER, s, tuple((r + 1 - s) % n for r in range(n))) for s in range(n - 1)]
    return scatter + gather


def contributions(n: int) -> list[list[list[frozenset[int]]]]:
    """frames[f][r][c]: whose values rank r has summed into its chunk c after f steps
    (frame 0 is the start, frame 2(N-1) the end)."""
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    frames = [holds]
    for step in ring_schedule(n):
        new = [row[:] for row in holds]
        for src, chunk in enumerate(step.sends):
            dst = (src + 1) % n
            arrived = holds[src][chunk]
            new[dst][chunk] = holds[dst][chunk] | arrived if step.phase == SCATTER_REDUCE else arrived
        holds = new
        frames.append(holds)
    return frames


def simulate_ring(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Run the ring in one process on N same-sized tensors (one per simulated rank).

    Chunks as in the lab: consecutive, sizes differing by at most one, the first numel % N one
    element longer (what torch.tensor_split does). Returns (each rank's result, bytes each rank sent)."""
    n = len(tensors)
    data = [t.clone().reshape(-1) for t in tensors]
    chunks = [list(d.tensor_split(n)) for d in data]
    sent = [0] * n
    for step in ring_schedule(n):
        outgoing = [chunks[r][step.sends[r]].clone() for r in range(n)]  # all ranks send at once
        for src in range(n):
            dst, c = (src + 1) % n, step.sends[src]
            sent[src] += outgoing[src].numel() * outgoing[src].element_size()
            if step.phase == SCATTER_REDUCE:
                chunks[dst][c] += outgoing[src]
            else:
                chunks[dst][c].copy_(outgoing[src])
    return [d.view_as(t) for d, t in zip(data, tensors)], sent


def bytes_sent(n: int, size: float) -> dict[str, float]:
    """Bytes that each rank sends in one all-reduce of `size` bytes on n ranks."""
    return {
        "ring, every rank": 2 * (n - 1) / n * size,
        "naive, root": (n - 1) * size,  # and it receives (n - 1) * size as well
        "naive, other ranks": size,
    }


# --- The naive way --------------------------------------------------------------------------------


def naive_all_reduce(tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place: everyone sends to `root`, which adds the
    tensors up and sends the sum back to everyone. The root moves 2(N-1) full tensors."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == root:
        incoming = torch.empty_like(tensor)
        for other in range(world_size):
            if other != root:
                dist.recv(incoming, src=other)
                tensor += incoming
        for request in [dist.isend(tensor, dst=other) for other in range(world_size) if other != root]:
            request.wait()
    else:
        dist.send(tensor, dst=root)
        dist.recv(tensor, src=root)
    return tensor


# --- Pictures -------------------------------------------------------------------------------------

LETTERS = "abcdefgh"


def frame_title(n: int, frame: int) -> str:
    steps = ring_schedule(n)
    if frame == len(steps):
        return f"{n} ranks, done: every rank holds every summed chunk"
    step = steps[frame]
    verb = "adds it to its own" if step.phase == SCATTER_REDUCE else "overwrites its copy"
    # steps are numbered from 0, as in ring_schedule and the formulas: step s of 0 .. N-2
    return (f"{n} ranks, {step.phase} step {step.index} (of 0 to {n - 2}): "
            f"each rank sends the outlined chunk to rank + 1, which {verb}")


def draw_frame(ax, n: int, frame: int) -> None:
    """A rank x chunk table after `frame` steps: each cell lists whose values it sums (rank 0 is
    'a', rank 1 'b', ...); darker means more ranks summed; outlined: what is sent next."""
    from matplotlib.patches import Rectangle

    holds = contributions(n)[frame]
    steps = ring_schedule(n)
    sending = steps[frame].sends if frame < len(steps) else (None,) * n
    font = 11 if n <= 4 else (9 if n <= 6 else 7)
    for r in range(n):
        for c in range(n):
            who = holds[r][c]
            shade = len(who) / n
            face = (1 - 0.55 * shade, 1 - 0.35 * shade, 1 - 0.05 * shade)
            outlined = sending[r] == c
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=face, edgecolor="crimson" if outlined else "grey",
                                   linewidth=3 if outlined else 0.8))
            label = "".join(LETTERS[k] for k in sorted(who)) + f"{c}"
            ax.text(c + 0.5, r + 0.45, label, ha="center", va="center", fontsize=font)
            if outlined:
                ax.text(c + 0.5, r + 0.82, f"to rank {(r + 1) % n}", ha="center", va="center",
                        fontsize=font - 2, color="crimson")
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=font)
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=font)
    ax.tick_params(length=0)
    ax.set_aspect("equal")
    for side in ax.spines.values():
        side.set_visible(False)


def draw_ring_steps(n: int, frames: list[int], width: float = 4.2):
    """Several frames of the ring side by side; returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(frames), figsize=(width * len(frames), width + 0.6))
    for ax, frame in zip(axes if len(frames) > 1 else [axes], frames):
        draw_frame(ax, n, frame)
        ax.set_title("\n".join(_wrap(frame_title(n, frame), 48)), fontsize=10)
    fig.tight_layout()
    return fig


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def step_through(max_ranks: int = 8):
    """An ipywidgets step-through: pick the number of ranks (2..max_ranks) and the step."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    ranks = widgets.IntSlider(value=4, min=2, max=max_ranks, description="ranks")
    # The slider counts frames, the steps done so far in both phases together (0 .. 2(N-1)), not a
    # phase's step number: at 5 ranks, all-gather step 1 is frame 5. The figure's title names the phase step.
    frame = widgets.IntSlider(value=0, min=0, max=2 * (ranks.value - 1), description="steps done",
                              style={"description_width": "initial"})
    out = widgets.Output()

    def redraw(*_):
        frame.max = 2 * (ranks.value - 1)
        with out:
            out.clear_output(wait=True)
            draw_ring_steps(ranks.value, [frame.value], width=max(5.0, 0.9 * ranks.value))
            plt.show()

    ranks.observe(redraw, names="value")
    frame.observe(redraw, names="value")
    redraw()
    display(widgets.VBox([widgets.HBox([ranks, frame]), out]))


# --- The cost model -------------------------------------------------------------------------------

METHODS = ("naive", "ring", "all_reduce")


def model_terms(method: str, n: int, size: float) -> tuple[float, float]:
    """(messages in sequence, bytes in sequence) on the busiest rank: t = messages*alpha + bytes*beta.

    ring (and gloo's all_reduce, also a ring on CPU): 2(N-1) steps, each one chunk of S/N.
    naive: the root receives N-1 tensors one after the other, then sends N-1.
    This is the single-port model (a rank's link carries one message at a time). For latency it
    overstates naive: its workers send at once and the root posts its sends together, so the chain
    of messages that wait for each other is 2 deep, against the ring's 2(N-1) (chapter 04, part A)."""
    if method == "naive":
        return 2 * (n - 1), 2 * (n - 1) * size
    return 2 * (n - 1), 2 * (n - 1) / n * size


def fit_alpha_beta(rows: list[dict], method: str) -> tuple[float, float]:
    """The one fit of the course: (alpha, beta) of t = messages*alpha + bytes*beta over the measured
    rows of one method (each row: ranks, bytes, seconds), by non-negative least squares (a latency or
    a time per byte below zero means nothing, so neither may be), each row weighted by 1/t so that
    the small sizes (latency) count as much as the large ones (bandwidth)."""
    import numpy as np
    from scipy.optimize import nnls

    picked = [row for row in rows if row["method"] == method]
    terms = np.array([model_terms(method, row["ranks"], row["bytes"]) for row in picked], dtype=float)
    times = np.array([row["seconds"] for row in picked])
    (alpha, beta), _ = nnls(terms / times[:, None], np.ones_like(times))
    return float(alpha), float(beta)


def predict(method: str, n: int, size: float, alpha: float, beta: float) -> float:
    messages, nbytes = model_terms(method, n, size)
    return messages * alpha + nbytes * beta


def load_bench(path: Path = BENCH_JSON) -> dict:
    return json.loads(Path(path).read_text())


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:g} {unit}"
        size /= 1024
    raise AssertionError


# --- The namespace cluster's results (`make cluster-bench` writes them; no root needed to read) ---


def load_cluster_results() -> dict[int, dict]:
    """hosts -> the stored measurement, for every host count measured; each row also gets its
    rank count (one rank per host), so that `fit_alpha_beta` reads it like the bench's rows."""
    found = {}
    for path in sorted(CLUSTER_DIR.glob("allreduce_*hosts.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            row["ranks"] = data["hosts"]
        found[data["hosts"]] = data
    return found


def plot_cluster(results: dict[int, dict], path: Path | None = None):
    """Measured time vs size per method and host count, against the bandwidth bound and the fit."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (hosts, data) in zip(axes[0], sorted(results.items())):
        link = data["link_bytes_per_s"]
        for method, style in (("naive", "o-"), ("ring", "s-"), ("ring_pipelined", "d-"), ("all_reduce", "^-")):
            rows = [r for r in data["rows"] if r["method"] == method]
            ax.plot([r["bytes"] / MiB for r in rows], [r["seconds"] * 1000 for r in rows], style, label=method)
        sizes = sorted({r["bytes"] for r in data["rows"]})
        ax.plot([s / MiB for s in sizes], [2 * (hosts - 1) / hosts * s / link * 1000 for s in sizes], "k--",
                label="bound 2(N-1)/N S/B")
        alpha, beta = fit_alpha_beta(data["rows"], "ring")
        ax.plot([s / MiB for s in sizes], [predict("ring", hosts, s, alpha, beta) * 1000 for s in sizes],
                ":", color="gray", label=f"ring fit: alpha {alpha * 1e3:.2f} ms, B {1 / beta / 1e6:.0f} MB/s")
        ax.set(xscale="log", yscale="log", xlabel="tensor size (MiB)", ylabel="time (ms)",
               title=f"{hosts} hosts, {data['rate']} links")
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
