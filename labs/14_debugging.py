"""Lab 14 - debugging: three broken jobs, each diagnosed and fixed.

Below are three short jobs as a colleague handed them to you. Each works on one process and
fails on several: one hangs, one dies with a message about sizes, one loses a rank mid-epoch
while the others wait. For each job:
  1. run the broken job as it was handed to you, with the tools of chapter 14 switched on, and
     find the rank at fault and the line where it parts ways from the others:
         OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/14_debugging.py --broken job1
     --broken prints each rank's pid (for `kill -USR1 <pid>`, or `py-spy dump --pid <pid>` if you
     have py-spy) and writes, after 5 s, each rank's Python stack and its flight recorder (its
     last collectives, with the lines that called them) to files in runs/lab14/job1/; a `kill -USR1`
     adds a fresh stack to its rank's file. A hung job1 waits 120 s before it times out (Ctrl-C
     ends it sooner); job2 and job3 run under TORCH_DISTRIBUTED_DEBUG=DETAIL with a 10 s timeout.
     The answer depends on the number of ranks: look at the one you will check with;
  2. write the fixed job (jobN_fixed) and record your diagnosis in `diagnose`.
The check runs the fixed jobs and compares their results with a single-process reference, and
checks that each diagnosis names the rank at fault and the line where it goes wrong.

Run it with 4 processes (2, 3 and 4 are accepted):
    make lab CH=14 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/14_debugging.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/14_debugging.py; edit that one.)

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringside import Rank
from ringside.data import regression

FEATURES = 8
N_TRAIN = 96  # divisible by 2, 3 and 4: every rank gets an equal shard of the training set
BATCH = 4  # jobs 1 and 3: samples per rank and step
LR = 0.1
TARGET_LOSS = 0.1  # job 1: train until the loss is below this...
MAX_STEPS = 60  # job 1: ...or for this many steps
N_VAL = 1001  # job 2: validation samples
LABEL_RANGE = 10.0  # job 3: the instrument that measured the labels writes NaN beyond +-10


# --- What the three jobs share (correct as it is) -------------------------------------------------


def training_data(device: torch.device, corrupt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same 96 samples on every rank; corrupt=True gives the labels as the instrument recorded
    them, NaN where a reading was out of its range (job 3)."""
    x, y = regression(N_TRAIN, FEATURES, seed=0).tensors
    if corrupt:
        y[y.abs() > LABEL_RANGE] = float("nan")
    return x.to(device), y.to(device)


def validation_data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1001 validation samples and the weights to evaluate, the same on every rank (job 2)."""
    x, y = regression(N_VAL, FEATURES, seed=1).tensors
    w = torch.linspace(-1, 1, FEATURES).reshape(FEATURES, 1)
    return x.to(device), y.to(device), w.to(device)


def my_training_shard(me: Rank, corrupt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the training data: rank r takes the samples r, r + W, r + 2W, ..."""
    x, y = training_data(me.device, corrupt)
    return x[me.rank::me.world_size], y[me.rank::me.world_size]


def new_weights(device: torch.device) -> torch.Tensor:
    return torch.zeros(FEATURES, 1, device=device, requires_grad=True)


def batch_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(x @ w, y)


def average_gradients_and_step(w: torch.Tensor, loss: torch.Tensor, me: Rank) -> None:
    """Backward, the gradient averaged over all ranks (one all_reduce), one SGD step."""
    w.grad = None
    loss.backward()
    dist.all_reduce(w.grad)
    with torch.no_grad():
        w -= LR * w.grad / me.world_size


# --- The three jobs as they were handed to you (leave these as they are) --------------------------


def job1_broken(me: Rank) -> tuple[torch.Tensor, int]:
    """SGD on mini-batches of BATCH samples per rank, cycling through the shard, until the loss is
    below TARGET_LOSS (checked before each step's update), at most MAX_STEPS steps. Returns the
    weights and the number of updates made."""
    x, y = my_training_shard(me)
    w, updates = new_weights(me.device), 0
    for step in range(MAX_STEPS):
        start = step * BATCH % len(x)
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        if loss.item() < TARGET_LOSS:
            break
        average_gradients_and_step(w, loss, me)
        updates += 1
    return w.detach(), updates


def job2_broken(me: Rank) -> float:
    """The mean squared error of fixed weights over all 1001 validation samples, each rank
    evaluating one chunk."""
    x, y, w = validation_data(me.device)
    x, y = x.chunk(me.world_size)[me.rank], y.chunk(me.world_size)[me.rank]
    errors = ((x @ w - y) ** 2).flatten()
    gathered = [torch.empty_like(errors) for _ in range(me.world_size)]
    dist.all_gather(gathered, errors)
    return torch.cat(gathered).mean().item()


def job3_broken(me: Rank) -> torch.Tensor:
    """One epoch of SGD on mini-batches of BATCH samples per rank, stopping before a NaN can
    spread into the weights. Returns the weights."""
    x, y = my_training_shard(me, corrupt=True)
    w = new_weights(me.device)
    for start in range(0, len(x), BATCH):
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss.item()} at sample {start} of my shard")
        average_gradients_and_step(w, loss, me)
    return w.detach()


# --- Your part: the three jobs fixed, and your diagnosis ------------------------------------------


def job1_fixed(me: Rank) -> tuple[torch.Tensor, int]:
    """Job 1, fixed: the same training, which ends at the first step whose loss - the mean of
    the ranks' batch losses - is below TARGET_LOSS, on every rank at that same step and before
    its update. Returns the weights and the number of updates made."""
    x, y = my_training_shard(me)
    w, updates = new_weights(me.device), 0
    for step in range(MAX_STEPS):
        start = step * BATCH % len(x)
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        # (stuck? `make hint CH=14` prints hint 1 of 3; run it again for the next)
        # TODO: end the loop here at the first step where the mean of the ranks' losses is below TARGET_LOSS
        raise NotImplementedError("the TODO above")
        average_gradients_and_step(w, loss, me)
        updates += 1
    return w.detach(), updates


def job2_fixed(me: Rank) -> float:
    """Job 2, fixed: the mean squared error over all 1001 validation samples, exact to float64
    precision (1e-10 relative), on every rank, each rank still evaluating its own chunk."""
    x, y, w = validation_data(me.device)
    x, y = x.chunk(me.world_size)[me.rank], y.chunk(me.world_size)[me.rank]
    errors = ((x @ w - y) ** 2).flatten()
    # (stuck? `make hint CH=14` prints hint 1 of 3; run it again for the next)
    # TODO: return the mean squared error over all 1001 samples, as a float, the same on every rank
    raise NotImplementedError("the TODO above")


def job3_fixed(me: Rank) -> torch.Tensor:
    """Job 3, fixed: the same epoch, but a step in which any rank's loss is not finite is skipped
    by every rank together (none raises, none updates its weights in that step)."""
    x, y = my_training_shard(me, corrupt=True)
    w = new_weights(me.device)
    for start in range(0, len(x), BATCH):
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
        # TODO: take the step as before, except when some rank's loss is not finite: then no rank takes it
        raise NotImplementedError("the TODO above")
    return w.detach()


def diagnose(world_size: int) -> dict:
    """Your diagnosis of each broken job at this world size, as --broken showed it: the rank at
    fault (the one that is not where the others are; the others only wait for it, or fail because
    of it), the line of its jobN_broken where it parts ways from the others, copied as it stands
    (where that is an `if`, its condition line and the line it guards are both accepted), and the
    cause in a sentence. The rank may depend on the world size: write it as an expression of
    world_size (a dict such as {2: ..., 3: ..., 4: ...}[world_size] will do)."""
    # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
    # TODO: return {"job1": {"rank": ..., "line": "...", "cause": "..."}, "job2": {...}, "job3": {...}}
    raise NotImplementedError("the TODO above")


if __name__ == "__main__":  # the check is in checks/lab14.py: you need not read it
    from checks import lab14
    lab14.run(N_TRAIN=N_TRAIN, BATCH=BATCH, LR=LR, TARGET_LOSS=TARGET_LOSS, MAX_STEPS=MAX_STEPS,
              training_data=training_data, validation_data=validation_data, new_weights=new_weights,
              batch_loss=batch_loss, job1_broken=job1_broken, job2_broken=job2_broken, job3_broken=job3_broken,
              job1_fixed=job1_fixed, job2_fixed=job2_fixed, job3_fixed=job3_fixed, diagnose=diagnose)
