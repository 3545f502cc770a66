"""Lab 01 - from one process to DDP: make a single-process training script data parallel.

The script trains a small network on real handwritten digits. As given in the chapter, it runs in
one process. Fill in the five TODOs so that it runs on every rank with DistributedDataParallel:
join the group, split the data, wrap the model, reshuffle every epoch, log from rank 0 only.
The check then trains the same model in one process on the same global batches and compares.

Run it with 4 processes:
    make lab CH=01 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/01_dp_to_ddp.py)
"""
# SOLUTION FILE

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
    # HINT 1: ringside.pick_backend() says which backend and device type suit this machine; torchrun's environment says everything else; always give the group a timeout
    # HINT 2: backend, device_type = pick_backend(); dist.init_process_group(backend, timeout=timedelta(seconds=30)); return device_for(device_type, int(os.environ["LOCAL_RANK"]))
    # BEGIN SOLUTION: join the group torchrun prepared (nccl with one GPU per process where there are enough GPUs, else gloo on the CPU; a timeout, not the 30-minute default) and return this process's device
    backend, device_type = pick_backend()
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    return device_for(device_type, int(os.environ["LOCAL_RANK"]))
    # END SOLUTION


def make_loader(dataset: Dataset) -> DataLoader:
    """Batches of BATCH_PER_RANK from this rank's own share of the data, shuffled with SEED."""
    # HINT 1: a sampler decides which samples a rank sees; torch.utils.data has one that gives each rank a different share of one shuffled order
    # HINT 2: DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=DistributedSampler(dataset, shuffle=True, seed=SEED)) - the batch size is per rank
    # BEGIN SOLUTION: return a DataLoader whose ranks together see every sample once per epoch, in an order shuffled with SEED, in batches of BATCH_PER_RANK per rank
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    return DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)
    # END SOLUTION


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """Put the model on `device` and make its gradients the average over all ranks."""
    # HINT 1: torch.nn.parallel.DistributedDataParallel averages gradients during backward; the model must be on its device first
    # HINT 2: DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    # BEGIN SOLUTION: return the model on `device`, wrapped so that backward() leaves the same averaged gradients on every rank
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # END SOLUTION


def train(model: nn.Module, loader: DataLoader, device: torch.device) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        # HINT 1: a DistributedSampler shuffles with its seed plus the epoch it was told
        # HINT 2: loader.sampler.set_epoch(epoch)
        # BEGIN SOLUTION: make this epoch's order differ from the last epoch's (the same on every rank)
        loader.sampler.set_epoch(epoch)
        # END SOLUTION
        total, batches = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # under DDP, this also averages the gradients over all ranks
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        # HINT 1: every rank runs this line; only one of them should speak
        # BEGIN SOLUTION: print f"epoch {epoch}: loss {total / batches:.4f}" once per epoch for the whole job
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {total / batches:.4f}")
        # END SOLUTION


if __name__ == "__main__":  # the check is in checks/lab01.py: you need not read it
    from checks import lab01
    lab01.run(SEED=SEED, SAMPLES=SAMPLES, BATCH_PER_RANK=BATCH_PER_RANK, EPOCHS=EPOCHS, LR=LR,
              make_model=make_model, setup=setup, make_loader=make_loader, wrap=wrap, train=train)
