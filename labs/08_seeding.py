"""Lab 08 - seeding: the same initial weights on every rank, different augmentations and dropout, identical reruns.

Run it with 4 processes:
    make lab CH=08 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/08_seeding.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/08_seeding.py; edit that one.)

import random
from itertools import combinations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from ringside import Checks, Rank, print0, run_lab
from ringside.compare import all_gather_tensor, flat_params

SEED = 1234


def seed_everything(seed: int, rank: int) -> int:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every GPU) with seed + rank,
    and return that number: each rank then draws its own dropout masks, and a rerun draws the same."""
    # TODO: compute seed + rank and pass it to random.seed, np.random.seed and torch.manual_seed (which seeds the GPUs too)
    raise NotImplementedError("the TODO above")


class Net(nn.Module):
    """A small classifier for 8x8 images, with dropout (a random mask drawn at every step)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_model(seed: int) -> Net:
    """A Net whose initial weights are the same on every rank: drawn from `seed` alone, without
    changing this rank's own random stream (seeded with seed + rank before this is called)."""
    # TODO: inside `with torch.random.fork_rng(devices=[]):` call torch.manual_seed(seed) and build the Net; the stream is restored on exit
    raise NotImplementedError("the TODO above")


class JitteredImages(Dataset):
    """Small 8x8 images (made from a fixed seed: here the data matters less than the random draws),
    each shifted by up to one pixel and given a little noise: the augmentation.

    Its random numbers come from its own NumPy Generator, made once in __init__ (as many augmentation
    libraries do). Each item also returns the first number it drew, so the check can compare draws."""

    def __init__(self, n: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        draw = self.rng.random()
        dx, dy = self.rng.integers(-1, 2, size=2)
        image = torch.roll(self.x[i], shifts=(int(dy), int(dx)), dims=(1, 2))
        image = image + 0.05 * torch.from_numpy(self.rng.standard_normal((1, 8, 8), dtype=np.float32))
        info = get_worker_info()
        return image, self.y[i], torch.tensor(draw, dtype=torch.float64), info.id if info else -1


def seed_worker(worker_id: int) -> None:
    """The DataLoader's worker_init_fn. A worker starts as a copy of the parent process, so every
    worker holds the same `dataset.rng`. Torch itself seeds each worker with base seed + worker_id
    (`torch.initial_seed()` in the worker); derive every other generator from that number."""
    # TODO: worker_seed = torch.initial_seed() % 2**32; seed random and np.random with it, and replace get_worker_info().dataset.rng with np.random.default_rng(worker_seed)
    raise NotImplementedError("the TODO above")


def make_loader(dataset: Dataset, seed: int, rank: int, world_size: int, batch_size: int = 16,
                workers: int = 2) -> DataLoader:
    """This rank's shard of `dataset`, shuffled alike on every rank (the sampler's seed is shared),
    loaded by `workers` processes whose seeds come from a generator seeded with seed + rank."""
    # TODO: a DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed); a torch.Generator seeded with seed + rank; a DataLoader with sampler, num_workers=workers, worker_init_fn=seed_worker and generator
    raise NotImplementedError("the TODO above")


def one_run(rank: int, world_size: int, device: torch.device) -> dict:
    """A whole small job from the seed: weights, dropout masks, one epoch of DDP training."""
    seed_everything(SEED, rank)
    model = build_model(SEED).to(device)
    initial = flat_params(model)
    mask = nn.Dropout(0.5)(torch.ones(256, device=device)) != 0  # this rank's next dropout mask
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = make_loader(JitteredImages(), SEED, rank, world_size)
    loader.sampler.set_epoch(0)
    draws, workers = [], []
    for images, labels, draw, worker in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(images.to(device)), labels.to(device)).backward()
        optimizer.step()
        draws.append(draw)
        workers.append(worker)
    return {"initial": initial, "mask": mask.cpu(), "final": flat_params(model),
            "draws": torch.cat(draws), "workers": torch.cat(workers)}


# ---- the checks ----

def check_weights_equal(checks: Checks, run: dict, rank: int) -> None:
    copies = all_gather_tensor(run["initial"])
    differ = [r for r, w in enumerate(copies) if not torch.equal(w, copies[0])]
    checks.expect(not differ, f"the initial weights of rank(s) {differ} differ from rank 0's: build the model "
                              f"from the shared seed (torch.manual_seed(seed) inside fork_rng), not seed + rank "
                              f"(DDP would then overwrite them with rank 0's, hiding the mistake)")


def check_masks_differ(checks: Checks, run: dict) -> None:
    masks = all_gather_tensor(run["mask"])
    same = [(a, b) for a, b in combinations(range(len(masks)), 2) if torch.equal(masks[a], masks[b])]
    checks.expect(not same, f"ranks {same} drew the same dropout mask: every rank drops the same units - "
                            f"seed torch with seed + rank, and keep the shared-seed model building inside "
                            f"fork_rng so it does not reset the rank's stream")


def check_draws_differ(checks: Checks, run: dict, rank: int) -> None:
    draws, workers = run["draws"], run["workers"]
    by_worker = {int(w): set(draws[workers == w].tolist()) for w in workers.unique()}
    if len(by_worker) > 1:
        shared = set.intersection(*by_worker.values())
        checks.expect(not shared, f"rank {rank}: its DataLoader workers drew the same augmentations "
                                  f"({len(shared)} equal draws): every worker copied dataset.rng - reseed it "
                                  f"in seed_worker from torch.initial_seed()")
    else:
        checks.fail(f"rank {rank}: all batches came from one worker: make_loader must use num_workers=workers")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(draws.tolist()))
    clash = [r for r, other in enumerate(every) if r != rank and set(other) & set(every[rank])]
    checks.expect(not clash, f"rank {rank} drew the same augmentations as rank(s) {clash}: the workers of "
                             f"every rank got the same base seed - seed the loader's generator with seed + rank")


def check_rerun(checks: Checks, first: dict, second: dict, rank: int) -> None:
    differ = [name for name in first if not torch.equal(first[name], second[name])]
    checks.expect(not differ, f"rank {rank}: a second run from the same seed gave different {differ}: "
                              f"something draws from an unseeded source (np.random.default_rng() without a "
                              f"seed, time, os.getpid) - derive every generator from the seed")


def check_ddp_in_sync(checks: Checks, run: dict) -> None:
    checks.expect(all(torch.equal(w, run["final"]) for w in all_gather_tensor(run["final"])),
                  "after training, the ranks' weights differ: DDP keeps them equal only when every rank "
                  "runs the same number of steps on the same model")


def main(me: Rank, checks: Checks) -> None:
    first = one_run(me.rank, me.world_size, me.device)
    check_weights_equal(checks, first, me.rank)
    check_masks_differ(checks, first)
    check_draws_differ(checks, first, me.rank)
    check_ddp_in_sync(checks, first)
    second = one_run(me.rank, me.world_size, me.device)  # the same job again, from the same seed
    check_rerun(checks, first, second, me.rank)
    print0(f"{len(first['draws'])} augmented samples per rank, 2 workers each; the job ran twice from seed {SEED}")


if __name__ == "__main__":
    run_lab(main, title="Lab 08 (seeding)")
