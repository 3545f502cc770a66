"""Lab 06 - sampler: split a data set between ranks exactly as DistributedSampler does, then find
the bug in a training loop that shows every epoch the same data in the same order.

Run it with 4 processes:
    make lab CH=06 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/06_sampler.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/06_sampler.py; edit that one.)

import itertools
import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.data import digits


def shard_indices(n: int, num_replicas: int, rank: int, epoch: int = 0, shuffle: bool = True,
                  seed: int = 0, drop_last: bool = False) -> list[int]:
    """The indices of a data set of n samples that `rank` reads in `epoch`, exactly as
    DistributedSampler gives them: every rank gets the same number of samples.

    1. The order: 0..n-1, or, with shuffle, a permutation drawn from a torch.Generator seeded
       with seed + epoch (the same on every rank, so the shards do not overlap).
    2. An equal share: with drop_last, cut the list to a multiple of num_replicas;
       without, pad it to the next multiple by repeating indices from its start.
    3. This rank's share: every num_replicas-th index, starting at position `rank`.
    """
    # TODO: order (torch.randperm with a generator seeded with seed + epoch when shuffling), then cut (drop_last) or pad by repeating from the start to a multiple of num_replicas, then take order[rank::num_replicas]
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
        return self.n // self.num_replicas if self.drop_last else math.ceil(self.n / self.num_replicas)


def indexed_digits(n: int = 300) -> TensorDataset:
    """The first n digits, each sample with its own index, so a loop can record what it read."""
    x, y = digits(n).tensors
    return TensorDataset(x, y, torch.arange(n))


def train(dataset: TensorDataset, epochs: int = 3, batch_size: int = 16, base_lr: float = 0.05,
          seed: int = 0) -> list[list[int]]:
    """A colleague's DDP training loop. Its loss goes down, yet the check finds a bug in the order
    in which it reads the data. Returns the sample indices this rank read, epoch by epoch."""
    torch.manual_seed(seed)
    model = DDP(nn.Linear(64, 10))
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    # the global batch is batch_size x world_size: scale the learning rate with it (linear rule)
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * dist.get_world_size())
    seen = []
    for epoch in range(epochs):
        # TODO: bug hunt - delete this raise, run the lab, read what the check says about the order of the data, and add the one missing line here
        raise NotImplementedError("the TODO above")
        order = []
        for x, y, index in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            order += index.tolist()
        seen.append(order)
        print0(f"epoch {epoch}: loss of the last batch on rank 0 {loss.item():.4f}")
    return seen


# ---------------------------------------------------------------------------- the checks

GRID = dict(n=(1, 3, 8, 10, 13, 17), world_size=(1, 2, 3, 4, 5), shuffle=(False, True),
            drop_last=(False, True), seed=(0, 7), epoch=(0, 1, 2))


def reference(n, world_size, rank, epoch, shuffle, seed, drop_last) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def likely_mistake(got, n, world_size, rank, epoch, shuffle, seed, drop_last) -> str:
    """Compare with what the classic mistakes would give, and name the one that fits."""
    want = reference(n, world_size, rank, epoch, shuffle, seed, drop_last)
    shards = [reference(n, world_size, r, epoch, shuffle, seed, drop_last) for r in range(world_size)]
    full = [i for row in itertools.zip_longest(*shards) for i in row if i is not None]  # before striding
    if len(got) != len(want):
        if drop_last:
            return (f"{len(got)} indices instead of {len(want)}: with drop_last=True every rank gets "
                    f"n // world_size samples - cut the list to a multiple of world_size")
        return (f"{len(got)} indices instead of {len(want)}: without drop_last every rank gets "
                f"ceil(n / world_size) samples - pad the list by repeating indices from its start")
    if shuffle and epoch > 0 and got == reference(n, world_size, rank, 0, shuffle, seed, drop_last):
        return "this is the order of epoch 0: seed the generator with seed + epoch"
    if got == full[rank * len(want):(rank + 1) * len(want)]:
        return ("this rank took a contiguous block: take every world_size-th index starting at the rank "
                "(order[rank::world_size])")
    if sorted(got) != sorted(want):
        return ("not the same indices: every rank must shuffle with the same generator seed "
                "(seed + epoch, not the rank), pad by repeating from the start, then stride")
    return "the right indices in the wrong order: shuffle, then pad or cut, then take order[rank::world_size]"


def check_grid(checks: Checks) -> None:
    """Every setting of the grid; this process checks the sampler ranks r with r % job size == its rank."""
    me, size = dist.get_rank(), dist.get_world_size()
    tried, first_failure = 0, None
    for n, world_size, shuffle, drop_last, seed, epoch in itertools.product(*GRID.values()):
        for rank in range(me, world_size, size):
            sampler = ShardSampler(range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            sampler.set_epoch(epoch)
            got = list(sampler)
            tried += 1
            if first_failure is None and got != reference(n, world_size, rank, epoch, shuffle, seed, drop_last):
                setting = (f"n={n}, world_size={world_size}, rank={rank}, shuffle={shuffle}, drop_last={drop_last}, "
                           f"seed={seed}, epoch={epoch}")
                want = reference(n, world_size, rank, epoch, shuffle, seed, drop_last)
                first_failure = (f"{setting}: yours {got[:6]}, DistributedSampler {want[:6]} - "
                                 f"{likely_mistake(got, n, world_size, rank, epoch, shuffle, seed, drop_last)}")
    checks.expect(first_failure is None, f"{first_failure}")
    print0(f"shard_indices agrees with DistributedSampler on {tried} settings (rank 0's share of the grid)"
           if first_failure is None else "shard_indices differs from DistributedSampler (see below)")


def check_training_order(checks: Checks, dataset: TensorDataset, seen: list[list[int]]) -> None:
    """Each epoch this rank must read its own share, in the order DistributedSampler gives
    after set_epoch(epoch): a new order every epoch, and the ranks together read everything."""
    rank, world_size, n = dist.get_rank(), dist.get_world_size(), len(dataset)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    for epoch, order in enumerate(seen):
        if len(order) >= n and world_size > 1:
            checks.fail(f"rank {rank} read {len(order)} samples in epoch {epoch}, the whole data set: give the "
                        f"DataLoader sampler=DistributedSampler(...) (not shuffle=True)")
            return
        covered = set().union(*(theirs[epoch] for theirs in everyone))
        checks.expect(len(covered) == n, f"epoch {epoch}: the ranks together read {len(covered)} of {n} samples")
    if len(seen) > 1 and seen[1] == seen[0]:
        checks.fail(f"rank {rank} read the same samples in the same order in epoch 0 and epoch 1: the loop never "
                    f"calls sampler.set_epoch(epoch), so every epoch shuffles with the same seed")
        return
    for epoch, order in enumerate(seen):
        want = reference(n, world_size, rank, epoch, True, 0, False)
        checks.expect(order == want, f"rank {rank}, epoch {epoch}: the order read is not DistributedSampler's "
                                     f"after set_epoch({epoch}) - call sampler.set_epoch(epoch) once per epoch")


def main(me: Rank, checks: Checks) -> None:
    check_grid(checks)
    dataset = indexed_digits(300)
    seen = train(dataset)
    check_training_order(checks, dataset, seen)


if __name__ == "__main__":
    run_lab(main, title="Lab 06 (sampler)")
