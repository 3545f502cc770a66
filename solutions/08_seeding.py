"""Lab 08 - seeding: the same initial weights on every rank, different augmentations and dropout, identical reruns.

Run it with 4 processes:
    make lab CH=08 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/08_seeding.py)
"""
# SOLUTION FILE

import random

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from ringside.compare import flat_params

SEED = 1234


def seed_everything(seed: int, rank: int) -> int:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every GPU) with seed + rank,
    and return that number: each rank then draws its own dropout masks, and a rerun draws the same."""
    # HINT 1: three libraries keep three global generators; each must be seeded, or it starts from whatever state the process had
    # HINT 2: rank_seed = seed + rank; random.seed(rank_seed); np.random.seed(rank_seed); torch.manual_seed(rank_seed) (it seeds the CPU and every GPU)
    # BEGIN SOLUTION: seed every global generator this rank draws from (Python, NumPy, torch on every device) with seed + rank, and return that number
    rank_seed = seed + rank
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    return rank_seed
    # END SOLUTION


class Net(nn.Module):
    """A small classifier for 8x8 images, with dropout (a random mask drawn at every step)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_model(seed: int, device: torch.device) -> Net:
    """A Net on `device` whose initial weights are the same on every rank: drawn from `seed` alone,
    without changing this rank's own random streams (seeded with seed + rank before this is called),
    neither the CPU's nor its GPU's."""
    # HINT 1: torch.random.fork_rng() saves the generators it is given and puts them back when the `with` block ends; inside it, seed and build
    # HINT 2: torch.manual_seed(seed) seeds the CPU *and every GPU*, but fork_rng with an empty devices list restores only the CPU's: list this rank's GPU too, devices=[device] when device.type == "cuda"
    # BEGIN SOLUTION: return the Net on `device`, its initial weights drawn from `seed` alone, and every random stream of this rank (CPU and GPU) as it was before the call
    rank_devices = [device] if device.type == "cuda" else []  # the GPU generator this rank draws from
    with torch.random.fork_rng(devices=rank_devices):
        torch.manual_seed(seed)
        return Net().to(device)
    # END SOLUTION


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
        info = get_worker_info()  # which worker, and the seed torch gave it (-1: the main process)
        return (image, self.y[i], torch.tensor(draw, dtype=torch.float64), info.id if info else -1,
                info.seed % 2**62 if info else -1, i)


def seed_worker(worker_id: int) -> None:
    """The DataLoader's worker_init_fn. A worker starts as a copy of the parent process, so every
    worker holds the same `dataset.rng`. Torch itself seeds each worker with base seed + worker_id
    (`torch.initial_seed()` in the worker); derive every other generator from that number."""
    # HINT 1: in a worker, torch.initial_seed() is already different per worker, per rank (the loader's generator) and the same on a rerun: build every other seed from it
    # HINT 2: worker_seed = torch.initial_seed() % 2**32 (NumPy wants 32 bits); random.seed and np.random.seed with it, and get_worker_info().dataset.rng = np.random.default_rng(worker_seed)
    # BEGIN SOLUTION: make this worker's augmentations its own (no two workers of any rank or epoch alike) and reproducible: reseed Python's random, NumPy's global generator and the dataset copy's rng from the seed torch gave the worker
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)
    get_worker_info().dataset.rng = np.random.default_rng(worker_seed)
    # END SOLUTION


def make_loader(dataset: Dataset, seed: int, rank: int, world_size: int, batch_size: int = 16,
                workers: int = 2) -> DataLoader:
    """This rank's shard of `dataset`, shuffled alike on every rank (the sampler's seed is shared),
    loaded by `workers` processes whose seeds come from a generator seeded with seed + rank."""
    # HINT 1: two seeds with two jobs: the sampler's must be the same on every rank (one shared permutation, cut into shards), the loader's generator must differ per rank (it draws the workers' seeds)
    # HINT 2: DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed); generator = torch.Generator().manual_seed(seed + rank); DataLoader(dataset, batch_size, sampler=..., num_workers=workers, worker_init_fn=seed_worker, generator=generator)
    # BEGIN SOLUTION: return this rank's DataLoader: shards that together cover the data set once, in an order the seed decides, `workers` worker processes seeded by seed_worker, worker seeds that differ between ranks and repeat on a rerun, and this rank's global random streams untouched
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    generator = torch.Generator().manual_seed(seed + rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      worker_init_fn=seed_worker, generator=generator)
    # END SOLUTION


def one_run(rank: int, world_size: int, device: torch.device) -> dict:
    """A whole small job from the seed: weights, dropout masks, one epoch of DDP training, and the
    augmentations of the next epoch."""
    seed_everything(SEED, rank)
    model = build_model(SEED, device)
    initial = flat_params(model)
    mask = nn.Dropout(0.5)(torch.ones(256, device=device)) != 0  # this rank's next dropout mask
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = make_loader(JitteredImages(), SEED, rank, world_size)
    start_epoch(loader, 0)
    draws, workers, worker_seeds, indices = [], [], [], []
    for images, labels, draw, worker, worker_seed, index in batches(loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(images.to(device)), labels.to(device)).backward()
        optimizer.step()
        draws.append(draw)
        workers.append(worker)
        worker_seeds.append(worker_seed)
        indices.append(index)
    start_epoch(loader, 1)
    next_draws = [draw for _, _, draw, *_ in batches(loader)]  # epoch 1's augmentations (no training)
    return {"initial": initial, "mask": mask.cpu(), "final": flat_params(model), "draws": torch.cat(draws),
            "workers": torch.cat(workers), "worker_seeds": torch.cat(worker_seeds), "indices": torch.cat(indices),
            "next_draws": torch.cat(next_draws)}


def start_epoch(loader: DataLoader, epoch: int) -> None:
    """Reshuffle the shards for `epoch` (chapter 06). A loader without a DistributedSampler has no
    set_epoch: check_shards names that mistake rather than a crash here."""
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)


def batches(loader: DataLoader):
    """The loader's batches. An error in a worker reaches this process as a long traceback in a
    message; when seed_worker raised it, one line says so and what the worker's error was."""
    try:
        yield from loader
    except Exception as error:
        if "in seed_worker" not in str(error):
            raise
        raise RuntimeError(seed_worker_failure(str(error))) from None


def seed_worker_failure(message: str) -> str:
    """The diagnosis for a worker whose seed_worker raised; `message` ends with the worker's error."""
    cause = message.strip().splitlines()[-1]
    if "2**32" in cause:  # np.random.seed (or RandomState) given torch's 64-bit worker seed
        return (f"seed_worker raised in a DataLoader worker ({cause}): torch's worker seed has 64 bits, "
                f"NumPy's legacy seeding takes 32 - seed with torch.initial_seed() % 2**32")
    return f"seed_worker raised in a DataLoader worker: {cause} (the worker's traceback is printed above)"


if __name__ == "__main__":  # the check is in checks/lab08.py: you need not read it
    from checks import lab08
    lab08.run(SEED=SEED, seed_everything=seed_everything, Net=Net, build_model=build_model,
              JitteredImages=JitteredImages, make_loader=make_loader, one_run=one_run)
