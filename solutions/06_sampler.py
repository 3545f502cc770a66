"""Lab 06 - sampler: split a data set between ranks exactly as DistributedSampler does, then find
the bug in a training loop that shows every epoch the same data in the same order.

Run it with 4 processes:
    make lab CH=06 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/06_sampler.py)
"""
# SOLUTION FILE

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
    # HINT 1: three stages, in this order: the order of all n indices (the same on every rank), an equal share (cut or pad the whole list to a multiple of num_replicas), then this rank's positions in it
    # HINT 2: shuffle with a torch.Generator of your own seeded with seed + epoch (pass it to torch.randperm: the global generator is the rank's own stream); pad by repeating from the start (order + order[:k], several times when n is tiny); take order[rank::num_replicas]
    # BEGIN SOLUTION: return the indices `rank` reads, exactly DistributedSampler's list after set_epoch(epoch); every rank must agree on the shuffled order, and the global random state must be left as it was
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).tolist()
    else:
        order = list(range(n))
    if drop_last:
        per_rank = n // num_replicas
        order = order[:per_rank * num_replicas]
    else:
        per_rank = math.ceil(n / num_replicas)
        order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]
    return order[rank::num_replicas]
    # END SOLUTION


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


def train(dataset: TensorDataset, device: torch.device, epochs: int = 3, batch_size: int = 16,
          base_lr: float = 0.05, seed: int = 0) -> list[list[int]]:
    """A colleague's DDP training loop. Its loss goes down, yet the check finds a bug in the order
    in which it reads the data. Returns the sample indices this rank read, epoch by epoch."""
    torch.manual_seed(seed)
    model = DDP(nn.Linear(64, 10).to(device))
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    # the global batch is batch_size x world_size: scale the learning rate with it (linear rule)
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * dist.get_world_size())
    seen = []
    for epoch in range(epochs):
        # HINT 1: the check prints what it saw: compare the order of epoch 0 and epoch 1 on one rank
        # HINT 2: DistributedSampler shuffles with seed + epoch, and only learns the epoch from sampler.set_epoch(epoch)
        # BEGIN SOLUTION: bug hunt - delete this raise, run the lab, read what the check says about the order of the data, and add the one missing line here
        sampler.set_epoch(epoch)
        # END SOLUTION
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


# --- The checks -----------------------------------------------------------------------------------

GRID = dict(n=(1, 3, 8, 10, 13, 17), world_size=(1, 2, 3, 4, 5), shuffle=(False, True),
            drop_last=(False, True), seed=(0, 7), epoch=(0, 1, 2))


def reference(n, world_size, rank, epoch, shuffle, seed, drop_last) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def variant(n, world_size, rank, epoch, shuffle, seed, drop_last, *, generator_seed=None, shuffled=None,
            pad="start", cut="end", take="stride") -> list[int]:
    """DistributedSampler's list, or what one classic mistake makes of it (see likely_mistake)."""
    if shuffle if shuffled is None else shuffled:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(
            seed + epoch if generator_seed is None else generator_seed)).tolist()
    else:
        order = list(range(n))
    per_rank = n // world_size if drop_last else -(-n // world_size)
    total = per_rank * world_size
    if drop_last:
        order = order[:total] if cut == "end" else order[n - total:]
    elif n:
        extra = total - n
        repeated = order * (1 + extra // n)
        padding = repeated[:extra] if pad == "start" else repeated[len(repeated) - extra:]
        order = order + padding
    if take == "stride":
        return order[rank::world_size]
    return order[rank * per_rank:(rank + 1) * per_rank]


def likely_mistake(got, n, world_size, rank, epoch, shuffle, seed, drop_last) -> str:
    """Compare with what the classic mistakes would give, and name the one that fits."""
    want = reference(n, world_size, rank, epoch, shuffle, seed, drop_last)
    setting = (n, world_size, rank, epoch, shuffle, seed, drop_last)
    if len(got) != len(want):
        if drop_last:
            return (f"{len(got)} indices instead of {len(want)}: with drop_last=True every rank gets "
                    f"n // world_size samples - cut the list to a multiple of world_size")
        if n < world_size:
            return (f"{len(got)} indices instead of {len(want)}: without drop_last every rank gets "
                    f"ceil(n / world_size) samples - pad the list by repeating indices from its start; with "
                    f"n={n} smaller than world_size the padding repeats the list more than once")
        return (f"{len(got)} indices instead of {len(want)}: without drop_last every rank gets "
                f"ceil(n / world_size) samples - pad the list by repeating indices from its start")
    known = [
        (dict(generator_seed=seed), "this is the order of epoch 0 in every epoch: seed the generator with seed + epoch"),
        (dict(generator_seed=seed + epoch + rank), "not the same indices: every rank must shuffle with the same "
                                                   "generator seed (seed + epoch, not the rank)"),
        (dict(generator_seed=epoch), "the seed was left out: seed the generator with seed + epoch"),
        (dict(shuffled=False), "the indices are in their plain order although shuffle=True: draw a permutation"),
        (dict(shuffled=True), "the indices are shuffled although shuffle=False: keep 0..n-1 in order"),
        (dict(take="block"), "this rank took a contiguous block: take every world_size-th index starting at the "
                             "rank (order[rank::world_size])"),
        (dict(pad="end"), "the padding repeats indices from the end of the list: DistributedSampler repeats "
                          "them from its start"),
        (dict(cut="start"), "with drop_last the list was cut at its start: keep the first n // world_size * "
                            "world_size indices"),
    ]
    for changes, hint in known:
        try:
            if got == variant(*setting, **changes):
                return hint
        except Exception:  # a variant that cannot exist for this setting
            pass
    if sorted(got) == sorted(want):
        return ("the right indices in the wrong order: shuffle the whole list, then pad or cut it, then take "
                "order[rank::world_size] (not the rank's part first)")
    return ("not the same indices: every rank must shuffle with the same generator seed (seed + epoch, not the "
            "rank), pad by repeating from the start, then take order[rank::world_size]")


def check_grid(checks: Checks) -> None:
    """Every setting of the grid; this process checks the sampler ranks r with r % job size == its rank.

    It also watches torch's global generator: a sampler must not reseed or draw from it (that is
    every rank's own stream, for dropout and augmentation)."""
    me, size = dist.get_rank(), dist.get_world_size()
    tried, first_failure = 0, None
    for n, world_size, shuffle, drop_last, seed, epoch in itertools.product(*GRID.values()):
        for rank in range(me, world_size, size):
            sampler = ShardSampler(range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            sampler.set_epoch(epoch)
            state = torch.get_rng_state()
            try:
                got = list(sampler)
            except NotImplementedError:
                raise
            except Exception as error:  # a crash on a corner of the grid is a finding, not the end
                got = f"{type(error).__name__}: {error}"
            touched = not torch.equal(state, torch.get_rng_state())
            torch.set_rng_state(state)
            tried += 1
            if first_failure is not None:
                continue
            want = reference(n, world_size, rank, epoch, shuffle, seed, drop_last)
            setting = (f"n={n}, world_size={world_size}, rank={rank}, shuffle={shuffle}, drop_last={drop_last}, "
                       f"seed={seed}, epoch={epoch}")
            if isinstance(got, str):
                first_failure = f"{setting}: shard_indices raised {got}"
            elif touched and got == want:
                # Two causes fit: torch.manual_seed in the sampler, or a permutation drawn from the
                # global generator that matched by chance (1 in 6 for n=3): name both.
                first_failure = (f"{setting}: the indices are right, but shard_indices changed torch's global "
                                 f"random state - either torch.manual_seed in the sampler (it resets every "
                                 f"rank's own stream, dropout and augmentation, each epoch) or the permutation "
                                 f"came from torch's global generator and matched by chance: seed a "
                                 f"torch.Generator of its own and pass it to torch.randperm(n, generator=...)")
            elif touched:
                first_failure = (f"{setting}: yours {got[:6]}, DistributedSampler {want[:6]} - the permutation "
                                 f"came from torch's global generator (each rank's own stream): pass your seeded "
                                 f"generator to torch.randperm(n, generator=generator)")
            elif got != want:
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
            checks.fail(f"read {len(order)} samples in epoch {epoch}, the whole data set: give the "
                        f"DataLoader sampler=DistributedSampler(...) (not shuffle=True)")
            return
    if seen and seen[0] == reference(n, world_size, rank, 0, False, 0, False):
        checks.fail("read its share in the plain order 0, W, 2W, ...: the sampler does not shuffle - "
                    "DistributedSampler(..., shuffle=True); set_epoch only changes a shuffled order")
        return
    for epoch in range(len(seen)):
        covered = set().union(*(theirs[epoch] for theirs in everyone))
        if len(covered) < n:
            own_seed = all(theirs[epoch] == reference(n, world_size, r, epoch, True, r, False)
                           for r, theirs in enumerate(everyone))
            cause = ("each rank shuffled with its own seed (seed + rank)" if own_seed else
                     "the ranks shuffled differently")
            checks.fail(f"epoch {epoch}: the ranks together read {len(covered)} of {n} samples and some twice - "
                        f"{cause}: DistributedSampler's seed must be the same on every rank, so that all "
                        f"ranks cut one shared permutation")
            return
    if len(seen) > 2 and seen[1] == seen[0] and seen[2] != seen[1]:
        checks.fail("epoch 1 read epoch 0's order, epoch 2 a new one: set_epoch is called, but too late - "
                    "call sampler.set_epoch(epoch) before the epoch's first batch, not after its last")
        return
    if len(seen) > 1 and seen[1] == seen[0]:
        checks.fail("read the same samples in the same order in epoch 0 and epoch 1: the loop never "
                    "calls sampler.set_epoch(epoch), so every epoch shuffles with the same seed")
        return
    for epoch, order in enumerate(seen):
        want = reference(n, world_size, rank, epoch, True, 0, False)
        if epoch and order == reference(n, world_size, rank, epoch - 1, True, 0, False):
            hint = (f"it is the order of epoch {epoch - 1}: set_epoch takes effect when the loader is "
                    f"iterated - call sampler.set_epoch(epoch) before the epoch's first batch")
        elif order == reference(n, world_size, rank, epoch + 1, True, 0, False):
            hint = f"it is the order of epoch {epoch + 1}: pass this epoch's number, set_epoch(epoch)"
        else:
            hint = "call sampler.set_epoch(epoch) once per epoch, before the loop over the loader"
        checks.expect(order == want, f"epoch {epoch}: the order read is not DistributedSampler's "
                                     f"after set_epoch({epoch}) - {hint}")


def main(me: Rank, checks: Checks) -> None:
    check_grid(checks)
    dataset = indexed_digits(300)
    seen = train(dataset, me.device)
    check_training_order(checks, dataset, seen)


if __name__ == "__main__":
    run_lab(main, title="Lab 06 (sampler)")
