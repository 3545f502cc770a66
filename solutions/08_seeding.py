"""Lab 08 - seeding: the same initial weights on every rank, different augmentations and dropout, identical reruns.

Run it with 4 processes:
    make lab CH=08 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/08_seeding.py)
"""
# SOLUTION FILE

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
    # BEGIN SOLUTION: make this worker's augmentations its own (no two workers of any rank alike) and reproducible: reseed Python's random, NumPy's global generator and the dataset copy's rng from the seed torch gave the worker
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
    # BEGIN SOLUTION: return this rank's DataLoader: shards that together cover the data set once, `workers` worker processes seeded by seed_worker, worker seeds that differ between ranks and repeat on a rerun
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    generator = torch.Generator().manual_seed(seed + rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      worker_init_fn=seed_worker, generator=generator)
    # END SOLUTION


def one_run(rank: int, world_size: int, device: torch.device) -> dict:
    """A whole small job from the seed: weights, dropout masks, one epoch of DDP training."""
    seed_everything(SEED, rank)
    model = build_model(SEED, device)
    initial = flat_params(model)
    mask = nn.Dropout(0.5)(torch.ones(256, device=device)) != 0  # this rank's next dropout mask
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = make_loader(JitteredImages(), SEED, rank, world_size)
    loader.sampler.set_epoch(0)
    draws, workers, worker_seeds, indices = [], [], [], []
    for images, labels, draw, worker, worker_seed, index in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(images.to(device)), labels.to(device)).backward()
        optimizer.step()
        draws.append(draw)
        workers.append(worker)
        worker_seeds.append(worker_seed)
        indices.append(index)
    return {"initial": initial, "mask": mask.cpu(), "final": flat_params(model), "draws": torch.cat(draws),
            "workers": torch.cat(workers), "worker_seeds": torch.cat(worker_seeds), "indices": torch.cat(indices)}


# --- The checks -----------------------------------------------------------------------------------

def check_seed_everything(checks: Checks, rank: int, device: torch.device) -> None:
    """Each global generator must continue exactly as a fresh one seeded with SEED + rank."""
    want = SEED + rank
    got = seed_everything(SEED, rank)
    draws = {"random": random.random(), "np.random": float(np.random.random()),
             "torch": torch.rand(4).tolist()}
    if device.type != "cpu":
        draws[f"torch on {device.type}"] = torch.rand(4, device=device).tolist()
    expected = {"random": random.Random(want).random(), "np.random": float(np.random.RandomState(want).random_sample()),
                "torch": torch.rand(4, generator=torch.Generator().manual_seed(want)).tolist()}
    if device.type != "cpu":
        expected[f"torch on {device.type}"] = torch.rand(
            4, device=device, generator=torch.Generator(device=device).manual_seed(want)).tolist()
    shared = {"random": random.Random(SEED).random(), "np.random": float(np.random.RandomState(SEED).random_sample())}
    checks.expect(got == want, f"seed_everything returned {got}, expected seed + rank = {want}")
    for name in expected:
        if draws[name] == expected[name]:
            continue
        if draws[name] == shared.get(name):
            checks.fail(f"{name} is seeded with the shared seed {SEED}: use seed + rank, so that ranks draw "
                        f"differently")
        else:
            call = {"random": "random.seed(seed + rank)", "np.random": "np.random.seed(seed + rank)"}.get(
                name, "torch.manual_seed(seed + rank)")
            checks.fail(f"{name} does not draw what a generator seeded with seed + rank = {want} draws: it is not "
                        f"seeded (or seeded with something else) - call {call} in seed_everything")


def check_streams_kept(checks: Checks, rank: int, device: torch.device) -> None:
    """build_model must leave this rank's streams where they were: on the CPU and on its device."""
    seed_everything(SEED, rank)
    expected = {"cpu": torch.rand(4)}
    if device.type != "cpu":
        expected[str(device)] = torch.rand(4, device=device).cpu()
    seed_everything(SEED, rank)
    build_model(SEED, device)
    got = {"cpu": torch.rand(4)}
    if device.type != "cpu":
        got[str(device)] = torch.rand(4, device=device).cpu()
    moved = [name for name in expected if not torch.equal(got[name], expected[name])]
    checks.expect(not moved, f"build_model changed this rank's random stream on {', '.join(moved)}: its dropout "
                             f"masks would then follow the shared seed - seed inside torch.random.fork_rng, and "
                             f"give it every device the rank draws from (an empty devices list restores only "
                             f"the CPU's generator, while torch.manual_seed also seeds every GPU)")


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


def check_shards(checks: Checks, run: dict, size: int) -> None:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, run["indices"].tolist())
    covered = set().union(*map(set, every))
    checks.expect(len(covered) == size,
                  f"the ranks together read {len(covered)} of the {size} samples (their shards overlap): "
                  f"DistributedSampler's seed must be the same on every rank (seed, not seed + rank), so that "
                  f"all ranks cut one shared permutation - only the loader's generator takes the rank")


def check_draws_differ(checks: Checks, run: dict, rank: int) -> None:
    draws, workers = run["draws"], run["workers"]
    by_worker = {int(w): set(draws[workers == w].tolist()) for w in workers.unique()}
    if len(by_worker) > 1:
        shared = set.intersection(*by_worker.values())
        checks.expect(not shared, f"its DataLoader workers drew the same augmentations ({len(shared)} equal "
                                  f"draws): every worker copied dataset.rng - reseed it in seed_worker "
                                  f"(worker_init_fn) from torch.initial_seed()")
    else:
        checks.fail("all batches came from one worker: make_loader must use num_workers=workers")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sorted(draws.tolist()), sorted(set(run["worker_seeds"].tolist()))))
    mine, my_seeds = set(every[rank][0]), set(every[rank][1])
    clash = [r for r, (other, _) in enumerate(every) if r != rank and set(other) & mine]
    same_seeds = [r for r, (_, seeds) in enumerate(every) if r != rank and set(seeds) & my_seeds]
    if not clash:
        checks.expect(True, "")
    elif same_seeds:
        checks.fail(f"drew the same augmentations as rank(s) {clash}: their workers got the same seeds from "
                    f"torch - seed the loader's generator with seed + rank")
    else:
        checks.fail(f"drew the same augmentations as rank(s) {clash}, although torch gave every worker of every "
                    f"rank its own seed: seed_worker must derive the new seeds from torch.initial_seed(), not "
                    f"from worker_id (the same on every rank) or a constant")


def check_rerun(checks: Checks, first: dict, second: dict, rank: int) -> None:
    differ = [name for name in first if not torch.equal(first[name], second[name])]
    checks.expect(not differ, f"a second run from the same seed gave different {differ}: "
                              f"something draws from an unseeded source (np.random.default_rng() without a "
                              f"seed, time, os.getpid) - derive every generator from the seed")


def check_ddp_in_sync(checks: Checks, run: dict) -> None:
    checks.expect(all(torch.equal(w, run["final"]) for w in all_gather_tensor(run["final"])),
                  "after training, the ranks' weights differ: DDP keeps them equal only when every rank "
                  "runs the same number of steps on the same model")


def main(me: Rank, checks: Checks) -> None:
    check_seed_everything(checks, me.rank, me.device)
    check_streams_kept(checks, me.rank, me.device)
    first = one_run(me.rank, me.world_size, me.device)
    check_weights_equal(checks, first, me.rank)
    check_masks_differ(checks, first)
    check_shards(checks, first, len(JitteredImages()))
    check_draws_differ(checks, first, me.rank)
    check_ddp_in_sync(checks, first)
    second = one_run(me.rank, me.world_size, me.device)  # the same job again, from the same seed
    check_rerun(checks, first, second, me.rank)
    print0(f"{len(first['draws'])} augmented samples per rank, 2 workers each; the job ran twice from seed {SEED}")


if __name__ == "__main__":
    run_lab(main, title="Lab 08 (seeding)")
