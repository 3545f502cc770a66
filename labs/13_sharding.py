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
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/13_sharding.py; edit that one.)

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
    # (stuck? `make hint CH=13` prints hint 1 of 2; run it again for the next)
    # TODO: return one detached vector: every tensor's elements in order, then the fewest zeros that make its length a multiple of world_size
    raise NotImplementedError("the TODO above")


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, stop) of `rank`'s shard in the padded vector of a `numel`-element model: the shards
    have equal sizes, lie in rank order, and together cover every element exactly once. This is the
    slice that reduce-scatter gives to `rank`."""
    # (stuck? `make hint CH=13` prints hint 1 of 2; run it again for the next)
    # TODO: return rank's (start, stop) in the padded vector: equal shards, in rank order, together covering it exactly once
    raise NotImplementedError("the TODO above")


def average_grad_shard(flat_grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the gradient averaged over all ranks. `flat_grad` is this rank's whole
    (padded) gradient; every rank passes one of the same length. Each rank receives only its own shard."""
    # (stuck? `make hint CH=13` prints hint 1 of 2; run it again for the next)
    # TODO: return this rank's shard of the average over all ranks of flat_grad, with one collective that delivers to each rank its own shard only
    raise NotImplementedError("the TODO above")


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                t: int, lr: float, betas: tuple[float, float], eps: float) -> None:
    """One Adam step on these tensors, in place, as torch.optim.Adam does it (no weight decay):
    update both moments with `grad`, then move `param`. `t` is the number of this step: 1, 2, 3, ..."""
    # (stuck? `make hint CH=13` prints hint 1 of 2; run it again for the next)
    # TODO: do step t of torch.optim.Adam in place: both moments and param change, exactly as Adam's would
    raise NotImplementedError("the TODO above")


@torch.no_grad()
def gather_params(shard: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Every rank sends its updated `shard`, receives everyone's, and writes the whole vector into
    `params`, in order: the padding at the end belongs to no parameter."""
    # (stuck? `make hint CH=13` prints hint 1 of 2; run it again for the next)
    # TODO: write every rank's updated shard into `params`, on every rank: each element takes its value from the rank whose shard holds it
    raise NotImplementedError("the TODO above")


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
        # (stuck? `make hint CH=13` prints hint 1 of 2; run it again for the next)
        # TODO: create Adam's two moments, self.exp_avg and self.exp_avg_sq, for this rank's shard only, on the parameters' device and dtype
        raise NotImplementedError("the TODO above")

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
        # (stuck? `make hint CH=13` prints hint 1 of 3; run it again for the next)
        # TODO: move every parameter, on every rank, as torch.optim.Adam on the gradients averaged over the ranks would - this rank computing Adam for its own shard only, with its own moments
        raise NotImplementedError("the TODO above")

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
