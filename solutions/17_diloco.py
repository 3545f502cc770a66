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
# SOLUTION FILE

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
    # HINT 1: the difference is this rank's own; an all-reduce makes it everyone's, in place on a tensor of your own.
    # HINT 2: flat = torch.cat([(a - p.detach()).reshape(-1) for ...]); dist.all_reduce(flat, op=dist.ReduceOp.AVG); then split it back by numel and view_as.
    # BEGIN SOLUTION: return the average over ranks of anchor - params, one new tensor per parameter, one all-reduce of the parameters' bytes (waited for if asynchronous)
    flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    return [d.view_as(p) for d, p in zip(flat.split([p.numel() for p in params]), params)]
    # END SOLUTION


class DiLoCo:
    """The outer optimizer of DiLoCo over a model's parameters: sync() every H inner steps."""

    def __init__(self, model: nn.Module, lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM):
        self.params = list(model.parameters())
        self.lr, self.momentum = lr, momentum
        # HINT 1: the anchor must stay where the parameters were while the inner optimizer moves them.
        # BEGIN SOLUTION: self.anchor: a copy of every parameter in memory of its own; self.buffers: a zero momentum buffer for each (same dtype and shape)
        self.anchor = [p.detach().clone() for p in self.params]
        self.buffers = [torch.zeros_like(p) for p in self.params]
        # END SOLUTION

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step, on every rank after its H inner steps: average the pseudo-gradient, take one
        step of SGD with Nesterov momentum on the anchor (torch.optim.SGD(lr, momentum, nesterov=True)'s
        rule), and start every rank's parameters again from the new anchor."""
        # HINT 1: SGD with nesterov=True: buf = momentum * buf + g; anchor -= lr * (g + momentum * buf).
        # HINT 2: g comes from average_pseudo_gradient(self.anchor, self.params); update self.buffers and self.anchor in place, then p.copy_(anchor) for every parameter.
        # BEGIN SOLUTION: anchor takes one Nesterov step on the averaged pseudo-gradient (momentum in self.buffers); every parameter becomes its new anchor
        deltas = average_pseudo_gradient(self.anchor, self.params)
        for p, anchor, buf, g in zip(self.params, self.anchor, self.buffers, deltas):
            buf.mul_(self.momentum).add_(g)
            anchor.sub_(g.add(buf, alpha=self.momentum), alpha=self.lr)
            p.copy_(anchor)
        # END SOLUTION

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the outer optimizer: tensors, lists and numbers only
        (torch.load(weights_only=True) reads it back)."""
        # BEGIN SOLUTION: return the anchor and the momentum buffers (and lr, momentum), enough to go on exactly where it stopped
        return {"anchor": [a.clone() for a in self.anchor], "buffers": [b.clone() for b in self.buffers],
                "lr": self.lr, "momentum": self.momentum}
        # END SOLUTION

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned, into this object's own tensors."""
        # BEGIN SOLUTION: put the saved anchor and momentum buffers (and lr, momentum) back, so the next sync is the one the saved run would have made
        for mine, saved in zip(self.anchor + self.buffers, state["anchor"] + state["buffers"]):
            mine.copy_(saved)
        self.lr, self.momentum = state["lr"], state["momentum"]
        # END SOLUTION


# --- The training that uses it ----------------------------------------------------------------------


def train(model: nn.Module, inner: torch.optim.Optimizer, outer: DiLoCo, batches, h: int = H) -> list[float]:
    """Inner steps of `inner` on this rank's batches, outer.sync() after every h-th of them (none after
    a last round shorter than h); returns the losses of the inner steps."""
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        # HINT 1: an ordinary training step, no communication; only every h-th step ends with a sync.
        # BEGIN SOLUTION: one inner step on (x, y) (zero the gradients, loss, backward, step), the loss kept; outer.sync() when step is a multiple of h
        inner.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        inner.step()
        losses.append(loss.item())
        if step % h == 0:
            outer.sync()
        # END SOLUTION
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
