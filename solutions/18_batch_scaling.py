"""Lab 18 - the gradient noise scale from the gradients data parallelism already has, and what it says
about how many ranks are worth adding.

Each rank holds its gradients on micro-batches of b samples (B_small = b); the all-reduce DDP does anyway
gives their average over every micro-batch of every rank (B_big = b x micro-batches per rank x ranks).
The two squared norms differ only by noise, and that difference measures the noise (McCandlish et al.
2018, "An empirical model of large-batch training", appendix A.1): since E|G_B|^2 = |G|^2 + tr(Sigma)/B,

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

both unbiased (|G_small|^2 averaged over every micro-batch of every rank). Their exponential averages over
steps give B_noise = tr(Sigma) / |G|^2: the batch past which each added sample buys less than half of what
it bought at a small batch (the chapter derives it). Then the learning rate for a global batch: linear or
square-root scaling of a base one, after a gradual warmup (Goyal et al. 2017).

The check compares your estimate with a direct float64 computation at 1-5 ranks (at 1 rank the micro-batches
stand in for ranks), in float32 and float64, on subgroups and on micro-batch counts the lab never uses, and
feeds your average, your schedule and your decision inputs of its own.

Run it with 4 processes:
    make lab CH=18 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/18_batch_scaling.py)
"""
# SOLUTION FILE

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ringside.data import digits

SEED = 0
MICRO = 8             # samples per micro-batch (B_small)
MICROS = 2            # micro-batches per rank per step (accumulation)
BASE_LR, BASE_BATCH = 0.1, 16    # the learning rate tuned at a batch of 16
WARMUP = 5            # steps of gradual warmup
BETA = 0.9            # the exponential average's decay


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))


# --- Your part: the estimate, its average, the schedule, the decision ----------------------------------


def noise_terms(micro_grads: list[torch.Tensor], micro_batch: int, group=None):
    """micro_grads: this rank's flat gradients, one per micro-batch of `micro_batch` samples (each a mean
    over its samples); every rank of `group` (None: all ranks) holds as many. Returns (mean, g2, trace):
    the gradient averaged over every micro-batch of every rank of the group (what DDP would step with),
    and the unbiased estimates of |G|^2 and tr(Sigma) as 0-dim tensors, all in the gradients' dtype and
    the same on every rank. The gradient's bytes cross the network once (plus a few numbers). With one
    micro-batch in the whole group there is nothing to compare: raise ValueError before any communication."""
    # HINT 1: B_small = micro_batch; B_big = micro_batch x micro-batches in the whole group. |G_small|^2 is the mean of every micro-batch's squared norm (over all ranks); |G_big|^2 the squared norm of the averaged gradient.
    # HINT 2: one all-reduce of the summed micro gradients (SUM, then divide by their count in the group), one of the summed squared norms; dist.get_world_size(group) ranks, not the whole job's.
    # BEGIN SOLUTION: the group-wide average gradient, then |G|^2 and tr(Sigma) from B_small and B_big by the two formulas of the docstring at the top, in the gradients' dtype
    count = len(micro_grads) * dist.get_world_size(group)
    if count < 2:
        raise ValueError("one micro-batch in the whole group: B_big = B_small, nothing to estimate from")
    mean = torch.stack(micro_grads).sum(0)
    small = torch.stack([g.square().sum() for g in micro_grads]).sum().reshape(1)
    dist.all_reduce(mean, group=group)
    dist.all_reduce(small, group=group)
    mean /= count
    small_sq, big_sq = small[0] / count, mean.square().sum()
    b_small, b_big = micro_batch, micro_batch * count
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return mean, g2, trace
    # END SOLUTION


class NoiseScale:
    """B_noise = tr(Sigma) / |G|^2 from exponential averages over steps of the two estimates."""

    def __init__(self, beta: float = BETA):
        self.beta = beta
        # BEGIN SOLUTION: both averages start at zero (as Adam's moments do)
        self.g2 = self.trace = 0.0
        # END SOLUTION

    def update(self, g2: float, trace: float) -> None:
        """Fold one step's estimates into the averages: avg <- beta x avg + (1 - beta) x new, for each."""
        # BEGIN SOLUTION: each average moves (1 - beta) of the way towards this step's estimate
        self.g2 = self.beta * self.g2 + (1 - self.beta) * float(g2)
        self.trace = self.beta * self.trace + (1 - self.beta) * float(trace)
        # END SOLUTION

    def value(self) -> float:
        """B_noise: the ratio of the two averages (not an average of per-step ratios: a step's |G|^2 estimate
        can be near zero or negative, and its ratio would swamp the rest). inf while the |G|^2 average is
        not positive (no signal yet: no batch is too large)."""
        # HINT 1: the averages of numerator and denominator, then one division.
        # BEGIN SOLUTION: tr(Sigma) average over |G|^2 average; inf when the |G|^2 average is <= 0
        return self.trace / self.g2 if self.g2 > 0 else math.inf
        # END SOLUTION


def scaled_lr(step: int, batch: int, base_lr: float, base_batch: int, warmup: int, rule: str) -> float:
    """The learning rate at `step` (0, 1, ...) for a global `batch`, from base_lr tuned at base_batch. The peak
    is base_lr x (batch / base_batch) for rule "linear", x sqrt(batch / base_batch) for "sqrt", base_lr for
    "none". Warmup: from base_lr at step 0 in a straight line to the peak at step `warmup`, then the peak
    (warmup = 0: the peak from the start)."""
    # HINT 1: peak first (one ratio, raised to 1, 1/2 or 0); then the fraction of the warmup done at this step, step / warmup, at most 1.
    # BEGIN SOLUTION: peak from the rule; base_lr + (peak - base_lr) x min(1, step / warmup), the peak when warmup is 0
    ratio = batch / base_batch
    peak = base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
    done = min(1.0, step / warmup) if warmup > 0 else 1.0
    return base_lr + (peak - base_lr) * done
    # END SOLUTION


def ranks_to_use(b_noise: float, per_rank_batch: int, available: int) -> int:
    """How many of `available` ranks to train on, each with per_rank_batch samples: the most whose global batch
    keeps every sample worth at least half of one at a tiny batch, B <= B_noise (at least 1 rank)."""
    # HINT 1: a sample at global batch B is worth B_noise / (B + B_noise) of one at a tiny batch: half when B = B_noise.
    # BEGIN SOLUTION: the largest n <= available with n x per_rank_batch <= b_noise, but never fewer than 1
    if math.isinf(b_noise):
        return available
    return max(1, min(available, math.floor(b_noise / per_rank_batch)))
    # END SOLUTION


# --- The training that uses it ------------------------------------------------------------------------


def flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over (x, y), flattened into one vector."""
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def batches(rank: int, world_size: int, steps: int, micros: int = MICROS):
    """`steps` lists of `micros` micro-batches of MICRO digits for this rank (the r-th slice of each global batch)."""
    x, y = digits().tensors
    per_step = world_size * micros * MICRO
    for step in range(steps):
        start = (step * per_step + rank * micros * MICRO) % (len(y) - micros * MICRO)
        yield [(x[s:s + MICRO], y[s:s + MICRO]) for s in range(start, start + micros * MICRO, MICRO)]


def train(model: nn.Module, steps, scale: NoiseScale, rule: str, group=None) -> list[float]:
    """SGD on the group-averaged gradient at scaled_lr for the global batch; B_noise after each step."""
    global_batch = MICRO * MICROS * dist.get_world_size(group)
    seen = []
    for step, micro_batches in enumerate(steps):
        mean, g2, trace = noise_terms([flat_grad(model, x, y) for x, y in micro_batches], MICRO, group)
        scale.update(g2, trace)
        lr = scaled_lr(step, global_batch, BASE_LR, BASE_BATCH, WARMUP, rule)
        with torch.no_grad():
            for p, g in zip(model.parameters(), mean.split([p.numel() for p in model.parameters()])):
                p.sub_(lr * g.view_as(p))
        seen.append(scale.value())
    return seen


if __name__ == "__main__":  # the check is in checks/lab18.py: you need not read it
    from checks import lab18
    lab18.run(SEED=SEED, MICRO=MICRO, MICROS=MICROS, BASE_LR=BASE_LR, BASE_BATCH=BASE_BATCH, WARMUP=WARMUP, BETA=BETA,
              make_model=make_model, noise_terms=noise_terms, NoiseScale=NoiseScale, scaled_lr=scaled_lr,
              ranks_to_use=ranks_to_use, batches=batches, train=train)
