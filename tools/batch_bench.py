"""Chapter 18's measurement: steps to a target loss against the global batch, and the noise scale beside it.

One process stands in for N ranks: a global batch of B samples is N ranks x B/N samples, and the mean of the
ranks' gradients is the gradient of the whole batch (chapter 18 shows the two equal), so the gradient of B
samples, taken in micro-batches of at most MICRO and averaged (accumulation), is what N ranks would all-reduce.
The model is a small MLP on the digits (ringside.data), trained from the same start at every batch size:

    sgd_tuned    SGD, the best of the TUNED learning rates at each batch (after the warmup): the curve of Shallue
                 et al. 2018, each batch size at its own best
    sgd_none     SGD, the learning rate tuned at the smallest batch, unchanged
    sgd_linear   SGD, lr x B / B0 after a gradual warmup (Goyal et al. 2017)
    sgd_sqrt     SGD, lr x sqrt(B / B0) after the warmup
    lars         sgd_linear with LARS's layer-wise trust ratio (You et al. 2017): each layer's step scaled
                 by ETA |w| / |g|, so no layer steps further than ETA of its own norm
    adam_sqrt    Adam, lr x sqrt(B / B0) after the warmup (Malladi et al. 2022's rule for adaptive optimizers)
    lamb         adam_sqrt with LAMB's trust ratio (You et al. 2019) on each layer's Adam update

For each, the number of steps until the loss over the whole training set is at or under TARGET (evaluated every
step; STEP_CAP when never), for SEEDS orders of the data. Beside it, along the smallest-batch SGD run, the noise
scale B_simple = tr(Sigma) / |G|^2 measured exactly from every training sample's own gradient, and the two-batch
estimate a DDP job gets for free (B_small = 8 per rank, B_big = 4 ranks x 8), averaged as lab 18 averages it.

    python -m tools.batch_bench        (writes assets/18_batch_scaling/sweep.json; about a minute of CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from ringside.data import digits_split

OUT = Path(__file__).resolve().parent.parent / "assets" / "18_batch_scaling" / "sweep.json"
BATCHES = (8, 16, 32, 64, 128, 256, 512, 1024)
BASE_BATCH = 8
RULES = {  # name -> (optimizer, peak lr's power of B / B0, trust ratio)
    "sgd_none": ("sgd", 0.0, False), "sgd_linear": ("sgd", 1.0, False), "sgd_sqrt": ("sgd", 0.5, False),
    "lars": ("sgd", 1.0, True), "adam_sqrt": ("adam", 0.5, False), "lamb": ("adam", 0.5, True),
}
BASE_LR = {"sgd": 0.4, "adam": 0.003}
WARMUP = 20       # steps of gradual warmup from the base lr to the scaled one
ETA = {"sgd": 0.2, "adam": 10.0}  # LARS, LAMB: a layer's step is eta x lr x |w|
TARGET = 0.3      # cross-entropy over the whole training set
STEP_CAP = 3000
MICRO = 128       # the largest micro-batch of the accumulation
SEEDS = (0, 1)
TUNED = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)  # sgd_tuned: the best of these peak lrs at each batch (Shallue et al.)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def batch_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of the mean loss over (x, y), accumulated over micro-batches of at most MICRO (each weighted
    by its share): what the ranks' all-reduced gradients would be."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for xs, ys in zip(x.split(MICRO), y.split(MICRO)):
        grads = torch.autograd.grad(F.cross_entropy(model(xs), ys), params)
        for t, g in zip(total, grads):
            t.add_(g, alpha=len(ys) / len(y))
    return total


def trust(weight: torch.Tensor, update: torch.Tensor, eta: float) -> float:
    """LARS/LAMB's layer-wise ratio: eta |w| / |update| (1 where either norm is 0)."""
    w, u = weight.norm().item(), update.norm().item()
    return eta * w / u if w > 0 and u > 0 else 1.0


def steps_to_target(rule: str, batch: int, seed: int, data, peak: float | None = None) -> int:
    """Steps until the training loss is at or under TARGET (STEP_CAP: never, or diverged). `peak`: the lr after
    the warmup, instead of the rule's."""
    kind, power, trusted = RULES[rule]
    model = make_model()
    params = list(model.parameters())
    x, y = data
    order = torch.Generator().manual_seed(seed)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    peak = BASE_LR[kind] * (batch / BASE_BATCH) ** power if peak is None else peak
    for step in range(STEP_CAP):
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y).item()
        if loss <= TARGET:
            return step
        if not loss < 10:  # diverged (or nan): it will not come back
            return STEP_CAP
        lr = BASE_LR[kind] + (peak - BASE_LR[kind]) * min(1.0, step / WARMUP)
        pick = torch.randint(len(y), (batch,), generator=order)
        grads = batch_gradient(model, x[pick], y[pick])
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                if kind == "adam":
                    m[i].mul_(0.9).add_(g, alpha=0.1)
                    v[i].mul_(0.999).addcmul_(g, g, value=0.001)
                    update = (m[i] / (1 - 0.9 ** (step + 1))) / ((v[i] / (1 - 0.999 ** (step + 1))).sqrt() + 1e-8)
                else:
                    update = g
                # LARS/LAMB: a weight matrix's step is ETA[kind] x lr x |w| long, whatever its gradient's size.
                p.sub_(update, alpha=lr * (trust(p, update, ETA[kind]) if trusted and p.dim() > 1 else 1.0))
    return STEP_CAP


def per_sample_noise(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) over the whole training set, from every sample's own gradient (exact, float64)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(y), -1) for g in per.values()], 1).double()
    mean = flat.mean(0)
    return mean.square().sum().item(), ((flat - mean).square().sum(1).sum() / (len(y) - 1)).item()


def noise_along_training(data, seed: int = 0, ranks: int = 4, per_rank: int = 8, beta: float = 0.9) -> list[dict]:
    """Plain SGD at B = ranks x per_rank (the base lr): at every step the two-batch estimate (per-rank gradients vs their mean),
    its running ratio of averages, and every 10 steps the exact B_simple from per-sample gradients."""
    model = make_model()
    params = list(model.parameters())
    x, y = data
    order = torch.Generator().manual_seed(seed)
    b_small, b_big = per_rank, per_rank * ranks
    ema_g2 = ema_trace = 0.0
    rows = []
    for step in range(STEP_CAP):
        with torch.no_grad():
            train_loss = F.cross_entropy(model(x), y).item()
        pick = torch.randint(len(y), (b_big,), generator=order)
        local = [batch_gradient(model, x[s], y[s]) for s in pick.split(per_rank)]
        flat = [torch.cat([g.reshape(-1) for g in gs]).double() for gs in local]
        mean = torch.stack(flat).mean(0)
        small_sq = torch.stack([f.square().sum() for f in flat]).mean().item()
        big_sq = mean.square().sum().item()
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
        ema_g2, ema_trace = beta * ema_g2 + (1 - beta) * g2, beta * ema_trace + (1 - beta) * trace
        row = {"step": step, "loss": round(train_loss, 5), "g2": g2, "trace": trace,
               "b_noise_running": ema_trace / ema_g2 if ema_g2 > 0 else None}
        if step % 10 == 0:
            exact_g2, exact_trace = per_sample_noise(model, x, y)
            row.update(exact_g2=exact_g2, exact_trace=exact_trace, b_simple=exact_trace / exact_g2)
        rows.append(row)
        if train_loss <= TARGET:
            break
        with torch.no_grad():
            for p, *gs in zip(params, *local):
                p.sub_(torch.stack(gs).mean(0), alpha=BASE_LR["sgd"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, _ = digits_split()
    data = train.tensors
    started = time.process_time()
    steps = {rule: {str(b): [steps_to_target(rule, b, s, data) for s in SEEDS] for b in BATCHES} for rule in RULES}
    tuned = {str(b): {str(lr): [steps_to_target("sgd_none", b, s, data, peak=lr) for s in SEEDS] for lr in TUNED}
             for b in BATCHES}
    steps["sgd_tuned"] = {b: min(row.values(), key=sum) for b, row in tuned.items()}
    for rule, row in steps.items():
        print(rule, {b: v for b, v in row.items()}, flush=True)
    noise = noise_along_training(data)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread", "cpu_seconds": None,
        "model": "64-32-10 MLP (tanh), digits training split (1,438 samples)", "target_loss": TARGET,
        "step_cap": STEP_CAP, "base_batch": BASE_BATCH, "base_lr": BASE_LR, "warmup": WARMUP, "eta": ETA,
        "micro_batch": MICRO, "seeds": list(SEEDS), "batches": list(BATCHES), "steps": steps, "tuned": tuned,
        "noise": {"ranks": 4, "per_rank": 8, "lr": BASE_LR["sgd"], "beta": 0.9, "rows": noise},
    }
    result["cpu_seconds"] = round(time.process_time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['cpu_seconds']} CPU-s)")


if __name__ == "__main__":
    main()
