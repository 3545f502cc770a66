"""Lab 17 - DiLoCo by hand: each rank trains alone for H steps, then the ranks all-reduce how far they
moved, once, and an outer optimizer with Nesterov momentum takes one step on that.

DDP all-reduces every gradient at every step. Over a slow link between data centres that is most of
the step. DiLoCo (Douillard et al. 2023) talks H times less often:

    inner:  H steps of AdamW on this rank's own batches, no communication at all
    outer:  pseudo-gradient = anchor - params   (the anchor: the parameters as they were at the last
                                                 sync, the same on every rank; the difference points
                                                 uphill, as a gradient does)
            average it over the ranks           (one all-reduce of the parameters' bytes)
            anchor <- one step of SGD with Nesterov momentum on the anchor, the average as its gradient
            params <- anchor                    (every rank starts the next H steps from the same point)

The outer step is exactly torch.optim.SGD(lr, momentum, nesterov=True) applied to the anchor with the
averaged pseudo-gradient as its .grad. Local SGD is the same with lr=1 and momentum=0: the new anchor
is then the plain average of the ranks' parameters.

The check sets the ranks' parameters itself and compares your outer steps with one process that does
them with torch.optim.SGD (several lr and momentum values, float32 and float64, odd shapes), counts the
bytes all-reduced per sync and per inner step, saves your state after some rounds and resumes it in new
objects (the run must go on bit for bit), and trains with your loop against one process that simulates
every rank.

Run it with 4 processes:
    make lab CH=17 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/17_diloco.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/17_diloco.py; edit that one.)

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ringside.data import digits

SEED = 0
H = 4                                   # inner steps between two syncs
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9     # DiLoCo's outer Nesterov (the paper's values)
INNER_LR = 0.01                         # the inner AdamW
BATCH = 16                              # samples per rank per inner step


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 13), nn.Tanh(), nn.Linear(13, 10))


# --- Your part: the outer step ----------------------------------------------------------------------


def average_pseudo_gradient(anchor: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The pseudo-gradient anchor[i] - params[i] of every parameter, averaged over the ranks: new tensors
    in the parameters' dtype and shapes, the same on every rank; anchor and params left as they are. All
    of it crosses the network in one all-reduce (one flat buffer) or one per tensor: the parameters'
    bytes once, no more."""
    # (stuck? `make hint CH=17` prints hint 1 of 2; run it again for the next)
    # TODO: return the average over ranks of anchor - params, one new tensor per parameter, one all-reduce of the parameters' bytes (waited for if asynchronous)
    raise NotImplementedError("the TODO above")


class DiLoCo:
    """The outer optimizer of DiLoCo over a model's parameters: sync() every H inner steps."""

    def __init__(self, model: nn.Module, lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM):
        self.params = list(model.parameters())
        self.lr, self.momentum = lr, momentum
        # (stuck? `make hint CH=17` prints hint 1 of 1; run it again for the next)
        # TODO: self.anchor: a copy of every parameter in memory of its own; self.buffers: a zero momentum buffer for each (same dtype and shape)
        raise NotImplementedError("the TODO above")

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step, on every rank after its H inner steps: average the pseudo-gradient, take one
        step of SGD with Nesterov momentum on the anchor (torch.optim.SGD(lr, momentum, nesterov=True)'s
        rule), and start every rank's parameters again from the new anchor."""
        # (stuck? `make hint CH=17` prints hint 1 of 2; run it again for the next)
        # TODO: anchor takes one Nesterov step on the averaged pseudo-gradient (momentum in self.buffers); every parameter becomes its new anchor
        raise NotImplementedError("the TODO above")

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the outer optimizer: tensors, lists and numbers only
        (torch.load(weights_only=True) reads it back)."""
        # TODO: return the anchor and the momentum buffers (and lr, momentum), enough to go on exactly where it stopped
        raise NotImplementedError("the TODO above")

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned, into this object's own tensors."""
        # TODO: put the saved anchor and momentum buffers (and lr, momentum) back, so the next sync is the one the saved run would have made
        raise NotImplementedError("the TODO above")


# --- The training that uses it ----------------------------------------------------------------------


def train(model: nn.Module, inner: torch.optim.Optimizer, outer: DiLoCo, batches, h: int = H) -> list[float]:
    """Inner steps of `inner` on this rank's batches, outer.sync() after every h-th of them (none after
    a last round shorter than h); returns the losses of the inner steps."""
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        # (stuck? `make hint CH=17` prints hint 1 of 1; run it again for the next)
        # TODO: one inner step on (x, y) (zero the gradients, loss, backward, step), the loss kept; outer.sync() when step is a multiple of h
        raise NotImplementedError("the TODO above")
    return losses


def batches(rank: int, world_size: int, steps: int):
    """`steps` batches of BATCH digits for this rank: rank r takes the r-th slice of each global batch."""
    x, y = digits().tensors
    for step in range(steps):
        start = ((step * world_size + rank) * BATCH) % (len(y) - BATCH)
        yield x[start:start + BATCH], y[start:start + BATCH]


if __name__ == "__main__":  # the check is in checks/lab17.py: you need not read it
    from checks import lab17
    lab17.run(SEED=SEED, H=H, OUTER_LR=OUTER_LR, OUTER_MOMENTUM=OUTER_MOMENTUM, INNER_LR=INNER_LR,
              make_model=make_model, average_pseudo_gradient=average_pseudo_gradient, DiLoCo=DiLoCo, train=train,
              batches=batches)
