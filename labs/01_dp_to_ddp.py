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

from ringside import Checks, pick_backend, run_lab
from ringside.compare import all_gather_tensor, flat_params, max_diff
from ringside.data import digits
from ringside.lab import captured_stdout
from ringside.runtime import device_for

SEED = 0
SAMPLES = 480  # divisible by 8 x (1..6 ranks): every rank gets whole batches, nothing is padded
BATCH_PER_RANK = 8
EPOCHS = 2
LR = 0.2


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights in every process and in the check
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


# --- Your part: the five steps from one process to DDP --------------------------------------


def setup() -> torch.device:
    """Join the process group that torchrun prepared; return the device this rank computes on."""
    # TODO: get (backend, device type) from ringside.pick_backend(), call dist.init_process_group(backend, timeout=timedelta(seconds=30)), return device_for(device type, LOCAL_RANK)
    raise NotImplementedError("the TODO above")


def make_loader(dataset: Dataset) -> DataLoader:
    """Batches of BATCH_PER_RANK from this rank's own share of the data, shuffled with SEED."""
    # TODO: replace DataLoader(dataset, BATCH_PER_RANK, shuffle=True) by one whose sampler is a DistributedSampler(dataset, shuffle=True, seed=SEED)
    raise NotImplementedError("the TODO above")


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """Put the model on `device` and make its gradients the average over all ranks."""
    # TODO: move the model to device and wrap it in DDP (device_ids=[device.index] on a GPU, None on the CPU)
    raise NotImplementedError("the TODO above")


def train(model: nn.Module, loader: DataLoader, device: torch.device) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        # TODO: tell the sampler which epoch this is, or every epoch repeats the same order
        raise NotImplementedError("the TODO above")
        total, batches = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # under DDP, this also averages the gradients over all ranks
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        # TODO: print f"epoch {epoch}: loss {total / batches:.4f}" - from rank 0 only
        raise NotImplementedError("the TODO above")


# --- The check: the same training in one process, on the same global batches ----------------


class RecordingDataset(Dataset):
    """The digits, noting the index of every sample this rank fetches."""

    def __init__(self, base):
        self.base, self.seen = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        self.seen.append(int(index))
        return self.base[index]

    def by_epoch(self, per_epoch: int) -> list[list[int]]:
        return [self.seen[i:i + per_epoch] for i in range(0, len(self.seen), per_epoch)]


def reference_weights(dataset, world_size: int) -> torch.Tensor:
    """One process, the same initial model, each step on the global batch: the union of every
    rank's batch at that step (PyTorch's own DistributedSampler says which samples those are)."""
    model, loss_fn = make_model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, y_all = dataset.tensors
    for epoch in range(EPOCHS):
        shards = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH_PER_RANK):
            batch = torch.tensor([i for shard in shards for i in shard[start:start + BATCH_PER_RANK]])
            optimizer.zero_grad()
            loss_fn(model(x_all[batch]), y_all[batch]).backward()
            optimizer.step()
    return flat_params(model)


def check_data(checks: Checks, seen: list[list[int]]) -> None:
    """Each epoch, the ranks' samples must split the data set; the order must change by epoch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    first_epoch = [set(s[0]) for s in everyone]
    if world_size > 1 and all(s == first_epoch[0] for s in first_epoch):
        checks.fail("every rank trained on the same samples - give the DataLoader a DistributedSampler")
    elif sum(len(s) for s in first_epoch) != SAMPLES or set().union(*first_epoch) != set(range(SAMPLES)):
        checks.fail(f"the ranks' samples do not split the {SAMPLES} samples exactly - use DistributedSampler "
                    f"(it gives rank r every world_size-th index of one shuffled order)")
    if len(seen) > 1 and seen[0] == seen[1]:
        checks.fail(f"rank {rank} saw its samples in the same order in every epoch - call "
                    f"loader.sampler.set_epoch(epoch) at the start of each epoch")
    checks.expect(len(seen) == EPOCHS, f"rank {rank} trained {len(seen)} epochs, expected {EPOCHS}")


def check_logging(checks: Checks, printed: str) -> None:
    rank, lines = dist.get_rank(), printed.strip().splitlines()
    if rank == 0:
        checks.expect(len(lines) == EPOCHS, f"rank 0 printed {len(lines)} lines while training, expected one "
                                            f"loss line per epoch ({EPOCHS})")
    else:
        checks.expect(not lines, f"rank {rank} printed {len(lines)} lines while training - log from rank 0 "
                                 f"only (if dist.get_rank() == 0: print(...))")


def check_weights(checks: Checks, model: nn.Module, dataset) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checks.expect(isinstance(model, DDP), f"rank {rank}: wrap() returned a {type(model).__name__}, "
                                          f"not a DistributedDataParallel")
    mine = flat_params(model)
    copies = all_gather_tensor(mine.to(next(model.parameters()).device))
    if any(max_diff(mine, copy.cpu()) > 0 for copy in copies):
        checks.fail("after training the weights differ between ranks - without DDP each rank follows its own "
                    "gradients; wrap the model in DistributedDataParallel so they are averaged")
        return
    # The weights are equal on every rank now, so rank 0 alone runs the reference and shares the gap.
    # Tolerance: the same sums in another order differ by float32 rounding (about 1e-7 per step);
    # 120 steps leave under 1e-5. A real mistake (wrong data, no averaging) moves weights by > 1e-2.
    gap = [max_diff(mine, reference_weights(dataset, world_size)) if rank == 0 else None]
    dist.broadcast_object_list(gap, src=0)
    gap = gap[0]
    checks.expect(gap <= 1e-5, f"the weights differ from the single-process run on the same global batches by "
                               f"{gap:.2e} (tolerance 1e-5): check the sampler's seed and the learning rate")


def check_loader(checks: Checks, loader: DataLoader) -> bool:
    return checks.expect(isinstance(loader.sampler, DistributedSampler),
                         f"the DataLoader samples with a {type(loader.sampler).__name__}, so every rank would train "
                         f"on the same samples - give it sampler=DistributedSampler(dataset, shuffle=True, seed=SEED)")


def main(checks: Checks) -> None:
    device = setup()
    dataset = RecordingDataset(digits(n=SAMPLES))
    loader = make_loader(dataset)
    if not check_loader(checks, loader):
        return
    model = wrap(make_model(), device)
    with captured_stdout(echo=dist.get_rank() == 0) as printed:
        train(model, loader, device)
    check_data(checks, dataset.by_epoch(len(loader.sampler)))
    check_logging(checks, printed.getvalue())
    check_weights(checks, model, dataset.base)


if __name__ == "__main__":
    run_lab(main, title="Lab 01 (dp_to_ddp)", world_sizes=range(1, 7), init=False)
