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

import multiprocessing
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


# --- The check: the same training in one process, on the same global batches ----------------------


class RecordingDataset(Dataset):
    """The digits, noting the index of every sample this rank fetches. The log is in shared memory,
    so DataLoader worker processes (num_workers > 0) write into the same log."""

    def __init__(self, base):
        self.base = base
        self.log = torch.full((4 * EPOCHS * len(base),), -1, dtype=torch.int64).share_memory_()
        self.count = multiprocessing.get_context("fork").Value("q", 0)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        with self.count.get_lock():
            slot = self.count.value
            self.count.value += 1
        if slot < len(self.log):
            self.log[slot] = int(index)
        return self.base[index]

    def by_epoch(self, per_epoch: int) -> list[list[int]]:
        seen = self.log[:min(self.count.value, len(self.log))].tolist()
        return [seen[i:i + per_epoch] for i in range(0, len(seen), per_epoch)] if per_epoch else []


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


def check_setup(checks: Checks, device) -> bool:
    """setup() joined the group and returned the device this rank should compute on."""
    if not checks.expect(dist.is_initialized(), "setup() returned without joining the process group - call "
                                                "dist.init_process_group"):
        return False
    backend, device_type = dist.get_backend(), pick_backend()[1]
    wanted = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device_type == "cuda" else torch.device("cpu")
    ok = isinstance(device, torch.device) and device == wanted
    return checks.expect(ok, f"setup() returned {device!r} with backend {backend}; this rank should compute on "
                             f"{wanted} - take the device type from pick_backend() and the GPU index from LOCAL_RANK")


def check_loader(checks: Checks, loader: DataLoader) -> bool:
    """The sampler's and loader's settings, read directly: each has its own classic mistake."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sampler = loader.sampler
    if not checks.expect(isinstance(sampler, DistributedSampler),
                         f"the DataLoader samples with a {type(sampler).__name__}, so every rank would train "
                         f"on the same samples - give it sampler=DistributedSampler(dataset, shuffle=True, seed=SEED)"):
        return False
    ok = True
    if (sampler.num_replicas, sampler.rank) != (world_size, rank):
        ok = checks.expect(False, f"the DistributedSampler was told num_replicas={sampler.num_replicas}, "
                                  f"rank={sampler.rank}, but this is rank {rank} of {world_size} - leave both out "
                                  f"(it reads them from the group)")
    if not sampler.shuffle:
        ok = checks.expect(False, "the DistributedSampler has shuffle=False: every epoch visits the samples in "
                                  "index order - pass shuffle=True")
    if sampler.seed != SEED:
        ok = checks.expect(False, f"the DistributedSampler's seed is {sampler.seed}, not SEED={SEED} - every rank "
                                  f"must shuffle with the same seed (seed + rank splits nothing: the ranks' "
                                  f"shares overlap)")
    if loader.batch_size != BATCH_PER_RANK:
        if loader.batch_size == BATCH_PER_RANK * world_size:
            hint = (f"that is the global batch: each rank's DataLoader takes BATCH_PER_RANK, and the "
                    f"{world_size} ranks together make the global batch of {BATCH_PER_RANK * world_size}")
        elif loader.batch_size == BATCH_PER_RANK // world_size:
            hint = ("you divided the batch by world_size: the sampler already splits the data, and "
                    "BATCH_PER_RANK is each rank's batch")
        else:
            hint = "each rank's DataLoader takes batch_size=BATCH_PER_RANK (the batch per rank)"
        ok = checks.expect(False, f"the DataLoader's batch size is {loader.batch_size}, expected "
                                  f"BATCH_PER_RANK={BATCH_PER_RANK}: {hint}")
    return ok


def check_data(checks: Checks, seen: list[list[int]], sampler) -> None:
    """Each epoch, the ranks' samples must split the data set; the order must change by epoch."""
    world_size = dist.get_world_size()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    if not checks.expect(all(len(s) == EPOCHS for s in everyone),
                         f"the ranks fetched samples for {[len(s) for s in everyone]} epochs, expected {EPOCHS}"):
        return
    first_epoch = [set(s[0]) for s in everyone]
    if world_size > 1 and all(s == first_epoch[0] for s in first_epoch):
        checks.fail("every rank trained on the same samples - give the DataLoader a DistributedSampler")
    elif sum(len(s) for s in first_epoch) != SAMPLES or set().union(*first_epoch) != set(range(SAMPLES)):
        checks.fail(f"the ranks' samples do not split the {SAMPLES} samples exactly - use DistributedSampler "
                    f"(it gives rank r every world_size-th index of one shuffled order)")
    # Told epoch by epoch: the sampler remembers the last set_epoch; the samples show the order.
    told = getattr(sampler, "epoch", None)
    same_order = len(seen) > 1 and seen[0] == seen[1]
    if told != EPOCHS - 1 or same_order:
        checks.fail(f"the sampler was last told epoch {told}, after {EPOCHS} epochs (0..{EPOCHS - 1})"
                    + (" and the samples came in the same order in every epoch" if same_order else "")
                    + " - call loader.sampler.set_epoch(epoch) at the start of each epoch")


def check_logging(checks: Checks, printed: str) -> None:
    rank, lines = dist.get_rank(), printed.strip().splitlines()
    if rank == 0:
        checks.expect(len(lines) == EPOCHS, f"printed {len(lines)} lines while training, expected one "
                                            f"loss line per epoch ({EPOCHS}) from rank 0")
    else:
        checks.expect(not lines, f"printed {len(lines)} lines while training - log from rank 0 "
                                 f"only (if dist.get_rank() == 0: print(...))")


def check_weights(checks: Checks, model: nn.Module, dataset) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checks.expect(isinstance(model, DDP), f"wrap() returned a {type(model).__name__}, not a DistributedDataParallel")
    mine = flat_params(model)
    if not checks.expect(bool(torch.isfinite(mine).all()), "the weights are NaN or inf after training"):
        return
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
                               f"{gap:.2e} (tolerance 1e-5): the sampler, batch size and DDP look right, so "
                               f"compare the training loop and learning rate with the chapter's")


def main(checks: Checks) -> None:
    device = setup()
    if not check_setup(checks, device):
        return
    dataset = RecordingDataset(digits(n=SAMPLES))
    loader = make_loader(dataset)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, check_loader(checks, loader))
    if not all(verdicts):  # every rank stops if any rank's loader is wrong (DDP would wait for it)
        return
    model = wrap(make_model(), device)
    with captured_stdout(echo=dist.get_rank() == 0) as printed:
        train(model, loader, device)
    check_data(checks, dataset.by_epoch(len(loader.sampler)), loader.sampler)
    check_logging(checks, printed.getvalue())
    check_weights(checks, model, dataset.base)


if __name__ == "__main__":
    run_lab(main, title="Lab 01 (dp_to_ddp)", world_sizes=range(1, 7), init=False)
