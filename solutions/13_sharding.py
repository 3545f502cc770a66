"""Lab 13 - a sharded optimizer by hand: Adam with its state split over the ranks (ZeRO stage 1).

Under DDP every rank keeps Adam's two moments for every parameter: the same numbers, N times.
Here each rank owns one shard of the parameters, flattened into one vector and padded with zeros
so that it splits into N equal shards. One optimizer step is:

    reduce-scatter the gradients (averaged): each rank receives the average of its own shard only
    Adam on that shard, with moments kept for that shard only
    all-gather the updated shards: every rank has every parameter again

The check trains the same model with DDP + torch.optim.Adam beside yours and compares the weights
after every step, measures your optimizer state in bytes (about 1/N of Adam's), and counts the
bytes your step hands to the collectives. The model has 985 parameters: not a multiple of 2, 3 or 4.

Run it with 4 processes:
    make lab CH=13 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/13_sharding.py)
"""
# SOLUTION FILE

import torch
import torch.distributed as dist
from torch import nn

from ringside.data import digits

SEED = 0
STEPS = 6
BATCH_PER_RANK = 16
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults, but a larger step


def make_model() -> nn.Module:
    """985 parameters (64*13 + 13 + 13*10 + 10): not a multiple of 2, 3 or 4, so shards need padding."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 13), nn.Tanh(), nn.Linear(13, 10))


# --- Your part: the pieces of a sharded Adam ------------------------------------------------------


def flatten_padded(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """All the tensors flattened into one vector, followed by zeros up to the next multiple of
    world_size (no zeros when the total already is one). On the tensors' device, detached."""
    # HINT 1: torch.cat of the flattened tensors, then torch.cat with a zero tensor of the missing length.
    # HINT 2: padded length = shard * world_size with shard = ceil(total / world_size) = -(-total // world_size).
    # BEGIN SOLUTION: return one detached vector: every tensor's elements in order, then the fewest zeros that make its length a multiple of world_size
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    missing = -flat.numel() % world_size
    return torch.cat([flat, flat.new_zeros(missing)])
    # END SOLUTION


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, stop) of `rank`'s shard in the padded vector of a `numel`-element model: the shards
    have equal sizes, lie in rank order, and together cover every element exactly once. This is the
    slice that reduce-scatter gives to `rank`."""
    # HINT 1: every shard has the same size, the total rounded UP to a multiple of world_size, divided by it.
    # HINT 2: size = -(-numel // world_size); rank r's shard is [r * size, (r + 1) * size).
    # BEGIN SOLUTION: return rank's (start, stop) in the padded vector: equal shards, in rank order, together covering it exactly once
    size = -(-numel // world_size)
    start = rank * size
    return start, start + size
    # END SOLUTION


def average_grad_shard(flat_grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the gradient averaged over all ranks. `flat_grad` is this rank's whole
    (padded) gradient; every rank passes one of the same length. Each rank receives only its own shard."""
    # HINT 1: one collective does both the sum and the split: dist.reduce_scatter_tensor(output, input, op=...) (torch 2.14 also names it reduce_scatter_single).
    # HINT 2: output = torch.empty(flat_grad.numel() // world_size) on flat_grad's device; op=dist.ReduceOp.AVG.
    # BEGIN SOLUTION: return this rank's shard of the average over all ranks of flat_grad, with one collective that delivers to each rank its own shard only
    shard = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(shard, flat_grad, op=dist.ReduceOp.AVG)
    return shard
    # END SOLUTION


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                t: int, lr: float, betas: tuple[float, float], eps: float) -> None:
    """One Adam step on these tensors, in place, as torch.optim.Adam does it (no weight decay):
    update both moments with `grad`, then move `param`. `t` is the number of this step: 1, 2, 3, ..."""
    # HINT 1: torch.optim.Adam's formulas: m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; param -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)
    # HINT 2: in place: exp_avg.lerp_(grad, 1 - b1); exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2); then param.addcdiv_(exp_avg, denominator, value=-step_size)
    # BEGIN SOLUTION: do step t of torch.optim.Adam in place: both moments and param change, exactly as Adam's would
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** t)
    denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-step_size)
    # END SOLUTION


@torch.no_grad()
def gather_params(shard: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Every rank sends its updated `shard`, receives everyone's, and writes the whole vector into
    `params`, in order: the padding at the end belongs to no parameter."""
    # HINT 1: dist.all_gather_into_tensor(full, shard) (all_gather_single in torch 2.14) fills `full` (world_size x shard elements) with every rank's shard.
    # HINT 2: keep full[:total], split it by the parameters' numel(), and copy_ each piece (view_as the parameter).
    # BEGIN SOLUTION: write every rank's updated shard into `params`, on every rank: each element takes its value from the rank whose shard holds it
    full = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(full, shard)
    total = sum(p.numel() for p in params)
    for p, new in zip(params, full[:total].split([p.numel() for p in params])):
        p.copy_(new.view_as(p))
    # END SOLUTION


class ShardedAdam:
    """Adam whose moments and update are split over the ranks (ZeRO-1). Every rank holds every
    parameter; each updates only its shard and keeps Adam's state for that shard only.

    With weight_decay > 0 it is AdamW (decoupled weight decay, as torch.optim.AdamW). Parameters
    that do not require gradients (frozen) are left alone. A trainable parameter that got no
    gradient counts as a zero gradient; torch's Adam would skip it for that step."""

    def __init__(self, params, lr: float = LR, betas: tuple[float, float] = BETAS, eps: float = EPS,
                 weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]  # frozen parameters are not optimized
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.steps = 0  # steps taken; Adam's bias correction needs it
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.stop = shard_range(self.numel, dist.get_rank(), dist.get_world_size())
        # HINT 1: Adam's moments start at zero and hold one number per element they cover; this rank covers its shard [start, stop) only, padding included.
        # HINT 2: torch.zeros(self.stop - self.start, device=..., dtype=...) with the first parameter's device and dtype, and torch.zeros_like of it for the second moment (two tensors, not one).
        # BEGIN SOLUTION: create Adam's two moments, self.exp_avg and self.exp_avg_sq, for this rank's shard only, on the parameters' device and dtype
        first = self.params[0]
        self.exp_avg = torch.zeros(self.stop - self.start, device=first.device, dtype=first.dtype)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        # END SOLUTION

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step: every rank has called backward() on its own batch, so each .grad is
        this rank's own gradient. Afterwards every rank holds the same, updated parameters."""
        world_size = dist.get_world_size()
        for p in self.params:
            if p.grad is None:  # not used in this step's forward: a zero gradient, on every rank alike
                p.grad = torch.zeros_like(p)
            if self.weight_decay:  # AdamW shrinks each weight before the Adam update (every rank alike)
                p.mul_(1 - self.lr * self.weight_decay)
        # HINT 1: the pieces above do it, in the order of the lab's docstring: this rank's averaged gradient shard, Adam on this rank's shard of the parameters, then every rank's updated shard back into the parameters.
        # HINT 2: the gradient and the parameters are flattened and padded the same way, so [self.start:self.stop] of each lines up; count the step before adam_update (Adam's first step has t = 1).
        # HINT 3: grad_shard = average_grad_shard(flatten_padded(grads, world_size)); param_shard = the [self.start:self.stop] slice of flatten_padded(self.params, world_size); self.steps += 1; adam_update(...); gather_params(param_shard, self.params)
        # BEGIN SOLUTION: move every parameter, on every rank, as torch.optim.Adam on the gradients averaged over the ranks would - this rank computing Adam for its own shard only, with its own moments
        grad_shard = average_grad_shard(flatten_padded([p.grad for p in self.params], world_size))
        param_shard = flatten_padded(self.params, world_size)[self.start:self.stop]
        self.steps += 1
        adam_update(param_shard, grad_shard, self.exp_avg, self.exp_avg_sq, self.steps, self.lr, self.betas, self.eps)
        gather_params(param_shard, self.params)
        # END SOLUTION

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


# --- The training that uses it --------------------------------------------------------------------


def batches(rank: int, world_size: int, device: torch.device):
    """STEPS batches of this rank's own BATCH_PER_RANK digits (rank r takes the r-th slice of each
    global batch), the same for your optimizer and for the DDP reference."""
    x, y = digits(n=STEPS * BATCH_PER_RANK * world_size).tensors
    for step in range(STEPS):
        start = (step * world_size + rank) * BATCH_PER_RANK
        yield x[start:start + BATCH_PER_RANK].to(device), y[start:start + BATCH_PER_RANK].to(device)


if __name__ == "__main__":  # the check is in checks/lab13.py: you need not read it
    from checks import lab13
    lab13.run(SEED=SEED, STEPS=STEPS, LR=LR, BETAS=BETAS, EPS=EPS, make_model=make_model,
              flatten_padded=flatten_padded, shard_range=shard_range, average_grad_shard=average_grad_shard,
              adam_update=adam_update, gather_params=gather_params, ShardedAdam=ShardedAdam, batches=batches)
