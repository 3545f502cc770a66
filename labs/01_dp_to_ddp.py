"""Lab 01 - from one process to DDP: make a single-process training script data parallel.

The script trains a small network on real handwritten digits. As given in the chapter, it runs in
one process. Fill in the five TODOs so that it runs on every rank with DistributedDataParallel:
join the group, split the data, wrap the model, reshuffle every epoch, log from rank 0 only.
The check then trains the same model in one process on the same global batches and compares.

Run it with 4 processes:
    make lab CH=01 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/01_dp_to_ddp.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/01_dp_to_ddp.py; edit that one.)

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ringside import pick_backend
from ringside.runtime import device_for

SEED = 1234  # not 0, DistributedSampler's default: a sampler without seed=SEED must show
SAMPLES = 480  # divisible by 8 x (1..6 ranks): every rank gets whole batches, nothing is padded
BATCH_PER_RANK = 8
EPOCHS = 2
LR = 0.2


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights in every process and in the check
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


# --- Your part: the five steps from one process to DDP --------------------------------------------


def setup() -> torch.device:
    """Join the process group that torchrun prepared; return the device this rank computes on."""
    # (stuck? `make hint CH=01` prints hint 1 of 2; run it again for the next)
    # TODO: join the group torchrun prepared (nccl with one GPU per process where there are enough GPUs, else gloo on the CPU; a timeout, not the 30-minute default) and return this process's device
    raise NotImplementedError("the TODO above")


def make_loader(dataset: Dataset) -> DataLoader:
    """Batches of BATCH_PER_RANK from this rank's own share of the data, shuffled with SEED."""
    # (stuck? `make hint CH=01` prints hint 1 of 2; run it again for the next)
    # TODO: return a DataLoader whose ranks together see every sample once per epoch, in an order shuffled with SEED, in batches of BATCH_PER_RANK per rank
    raise NotImplementedError("the TODO above")


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """Put the model on `device` and make its gradients the average over all ranks."""
    # (stuck? `make hint CH=01` prints hint 1 of 2; run it again for the next)
    # TODO: return the model on `device`, wrapped so that backward() leaves the same averaged gradients on every rank
    raise NotImplementedError("the TODO above")


def train(model: nn.Module, loader: DataLoader, device: torch.device) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        # (stuck? `make hint CH=01` prints hint 1 of 2; run it again for the next)
        # TODO: make this epoch's order differ from the last epoch's (the same on every rank)
        raise NotImplementedError("the TODO above")
        total, batches = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # under DDP, this also averages the gradients over all ranks
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        # (stuck? `make hint CH=01` prints hint 1 of 1; run it again for the next)
        # TODO: print f"epoch {epoch}: loss {total / batches:.4f}" once per epoch for the whole job
        raise NotImplementedError("the TODO above")


if __name__ == "__main__":  # the check is in checks/lab01.py: you need not read it
    from checks import lab01
    lab01.run(SEED=SEED, SAMPLES=SAMPLES, BATCH_PER_RANK=BATCH_PER_RANK, EPOCHS=EPOCHS, LR=LR,
              make_model=make_model, setup=setup, make_loader=make_loader, wrap=wrap, train=train)
