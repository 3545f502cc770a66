"""Lab 06 - sampler: split a data set between ranks exactly as DistributedSampler does, then find
the bug in a training loop that shows every epoch the same data in the same order.

Run it with 4 processes:
    make lab CH=06 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/06_sampler.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/06_sampler.py; edit that one.)

import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from ringside import print0
from ringside.data import digits


def shard_indices(n: int, num_replicas: int, rank: int, epoch: int = 0, shuffle: bool = True,
                  seed: int = 0, drop_last: bool = False) -> list[int]:
    """The indices that `rank` of `num_replicas` ranks reads from a data set of n samples in `epoch`:
    exactly the list of DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last) after
    set_epoch(epoch), for any n (n smaller than num_replicas too). Every rank gets the same number of
    indices, and all ranks build their lists from one shared order. Sections 1 and 2 of the notebook
    show how the sampler builds them."""
    # (stuck? `make hint CH=06` prints hint 1 of 3; run it again for the next)
    # TODO: return the indices `rank` reads in `epoch`, the same list as DistributedSampler's (see the docstring); leave torch's global random state as it was
    raise NotImplementedError("the TODO above")


class ShardSampler(Sampler[int]):
    """A drop-in for DistributedSampler built on shard_indices (call set_epoch every epoch)."""

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        self.n, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(shard_indices(self.n, self.num_replicas, self.rank, self.epoch, self.shuffle, self.seed,
                                  self.drop_last))

    def __len__(self) -> int:
        return len(shard_indices(self.n, self.num_replicas, self.rank, self.epoch, self.shuffle, self.seed,
                                 self.drop_last))


def indexed_digits(n: int = 300) -> TensorDataset:
    """The first n digits, each sample with its own index, so a loop can record what it read."""
    x, y = digits(n).tensors
    return TensorDataset(x, y, torch.arange(n))


def train(dataset: TensorDataset, device: torch.device, epochs: int = 3, batch_size: int = 16,
          base_lr: float = 0.05, seed: int = 0) -> list[list[int]]:
    """A colleague's DDP training loop. Its loss goes down, yet it has a bug in what it feeds the
    model. Returns the sample indices this rank read, epoch by epoch."""
    torch.manual_seed(seed)
    model = DDP(nn.Linear(64, 10).to(device))
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    # the global batch is batch_size x world_size: scale the learning rate with it (linear rule)
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * dist.get_world_size())
    seen = []
    for epoch in range(epochs):
        # (stuck? `make hint CH=06` prints hint 1 of 2; run it again for the next)
        # TODO: bug hunt - this loop trains as a single process on the whole data set would not: find what, and fix it (one line). Delete this raise, run the lab, and compare what the check says each epoch read with what you expect
        raise NotImplementedError("the TODO above")
        order = []
        for x, y, index in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            order += index.tolist()
        seen.append(order)
        print0(f"epoch {epoch}: loss of the last batch on rank 0 {loss.item():.4f}")
    return seen


if __name__ == "__main__":  # the check is in checks/lab06.py: you need not read it
    from checks import lab06
    lab06.run(ShardSampler=ShardSampler, indexed_digits=indexed_digits, train=train)
