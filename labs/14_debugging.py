"""Lab 14 - debugging: three broken jobs, each diagnosed and fixed.

Below are three short jobs as a colleague handed them to you. Each works on one process and
fails on several: one hangs, one dies with a message about sizes, one loses a rank mid-epoch
while the others wait. For each job:
  1. run the broken job and find the faulty rank and line with the tools of chapter 14:
         OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/14_debugging.py --broken job1
     (--broken runs that job as it was handed to you, with TORCH_DISTRIBUTED_DEBUG=DETAIL and the
     flight recorder on, a 10 s timeout, and each rank's pid printed: `kill -USR1 <pid>` from
     another terminal dumps that rank's Python stack, `py-spy dump --pid <pid>` too if you have it);
  2. write the fixed job (jobN_fixed) and record your diagnosis in `diagnose`.
The check runs the fixed jobs and compares their results with a single-process reference, and
checks that each diagnosis names the rank at fault and the line where it goes wrong.

Run it with 4 processes (2, 3 and 4 are accepted):
    make lab CH=14 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/14_debugging.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/14_debugging.py; edit that one.)

import os
import sys

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringside import Rank
from ringside.data import regression

BROKEN = sys.argv[sys.argv.index("--broken") + 1] if "--broken" in sys.argv[:-1] else None
if BROKEN:  # the debugging tools must be switched on before the process group exists
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # collectives compared across ranks
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")  # the flight recorder: last 64 collectives
    dist.set_debug_level_from_env()  # torch.distributed read the variable when it was imported

FEATURES = 8
N_TRAIN = 96  # divisible by 2, 3 and 4: every rank gets an equal shard of the training set
STEPS = 9  # job 1: full-batch steps
LOG_EVERY = 4  # job 1: log the loss at steps 0, 4, 8
LR = 0.1
N_VAL = 1001  # job 2: validation samples
BATCH = 4  # job 3: samples per rank and step
BAD_SAMPLE = 37  # job 3: the index of a corrupt record


# --- What the three jobs share (correct as it is) -------------------------------------------------


def training_data(device: torch.device, corrupt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same 96 samples on every rank; corrupt=True spoils one record with a NaN (job 3)."""
    x, y = regression(N_TRAIN, FEATURES, seed=0).tensors
    if corrupt:
        x[BAD_SAMPLE, 0] = float("nan")
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


def job1_broken(me: Rank) -> tuple[torch.Tensor, list[float]]:
    """Train on full batches and log the mean loss over all ranks every LOG_EVERY steps.
    Returns the weights and the logged losses (rank 0 logs)."""
    x, y = my_training_shard(me)
    w, logged = new_weights(me.device), []
    for step in range(STEPS):
        loss = batch_loss(w, x, y)
        average_gradients_and_step(w, loss, me)
        if me.is_main and step % LOG_EVERY == 0:
            dist.all_reduce(loss)
            logged.append(loss.item() / me.world_size)
    return w.detach(), logged


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


def job1_fixed(me: Rank) -> tuple[torch.Tensor, list[float]]:
    """Job 1, fixed: the same training and the same log (rank 0's `logged` holds the mean loss
    over all ranks at steps 0, 4, 8), and no rank ever waits for ever."""
    x, y = my_training_shard(me)
    w, logged = new_weights(me.device), []
    for step in range(STEPS):
        loss = batch_loss(w, x, y)
        average_gradients_and_step(w, loss, me)
        # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
        # TODO: every LOG_EVERY steps, rank 0 appends the mean of the ranks' losses to `logged`; every rank must take part in whatever collective that needs
        raise NotImplementedError("the TODO above")
    return w.detach(), logged


def job2_fixed(me: Rank) -> float:
    """Job 2, fixed: the mean squared error over all 1001 validation samples, exact, on every
    rank, each rank still evaluating its own chunk."""
    x, y, w = validation_data(me.device)
    x, y = x.chunk(me.world_size)[me.rank], y.chunk(me.world_size)[me.rank]
    errors = ((x @ w - y) ** 2).flatten()
    # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
    # TODO: combine the ranks' squared errors into the mean over all 1001 samples (sum and count, in float64, added up over the ranks) and return it as a float
    raise NotImplementedError("the TODO above")


def job3_fixed(me: Rank) -> torch.Tensor:
    """Job 3, fixed: the same epoch, but a step in which any rank's loss is not finite is skipped
    by every rank together (none raises, none updates its weights in that step)."""
    x, y = my_training_shard(me, corrupt=True)
    w = new_weights(me.device)
    for start in range(0, len(x), BATCH):
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
        # TODO: let every rank learn whether any rank's loss is not finite, and if so skip the step on every rank; else average the gradients and step as before
        raise NotImplementedError("the TODO above")
    return w.detach()


def diagnose(world_size: int) -> dict:
    """Your diagnosis of each broken job at this world size: the rank at fault, the line of its
    jobN_broken where things go wrong (copied as it stands), and the cause in a sentence.

    The rank at fault: job 1, the rank that calls a collective the others never call; job 2, the
    rank whose tensor has a shape unlike the others'; job 3, the rank that raised first (the others
    only waited for it). Write a rank that depends on the world size as an expression of it."""
    # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
    # TODO: return {"job1": {"rank": ..., "line": "...", "cause": "..."}, "job2": {...}, "job3": {...}}
    raise NotImplementedError("the TODO above")


if __name__ == "__main__":  # the check is in checks/lab14.py: you need not read it
    from checks import lab14
    lab14.run(BROKEN=BROKEN, N_TRAIN=N_TRAIN, STEPS=STEPS, LOG_EVERY=LOG_EVERY, LR=LR, BATCH=BATCH,
              training_data=training_data, validation_data=validation_data, new_weights=new_weights,
              batch_loss=batch_loss, job1_broken=job1_broken, job2_broken=job2_broken, job3_broken=job3_broken,
              job1_fixed=job1_fixed, job2_fixed=job2_fixed, job3_fixed=job3_fixed, diagnose=diagnose)
