"""Data-parallel training with torchrun (DDP, or FSDP2 with --fsdp): a template to copy and adapt.

Plain PyTorch, the standard library and tqdm: nothing from the course. The parts you replace for your
own work come first, in "What you replace": `build_datasets`, `build_model`, `fsdp_blocks`, `loss_fn`,
`metric_sums` with `BEST_METRIC`, and (maybe) `collate`, `split_batch` and `build_optimizer`; see
template/README.md. Everything after them (the process group, sharding, mixed precision,
accumulation, exact evaluation, checkpoints, resume, signals) works as is on CPUs (gloo) and GPUs
(nccl).

One machine (1 process, or one per GPU / 4 CPU processes):
    torchrun --standalone --nproc-per-node 1 template/train_ddp.py --out runs/demo
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 template/train_ddp.py --out runs/demo
A model too big for one GPU: add --fsdp (built on the meta device; parameters, gradients and optimizer
state sharded).
Two machines, static rendezvous (run on each; --node-rank 0 on the machine at MASTER_IP):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr MASTER_IP --master-port 29500 \\
        template/train_ddp.py --out /shared/runs/demo
Two machines, c10d rendezvous (the same command on both; survives a crashed rank with --max-restarts):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint MASTER_IP:29500 \\
        --rdzv-id demo --max-restarts 3 template/train_ddp.py --out /shared/runs/demo
Slurm: template/train_ddp.sbatch. On several machines --out must be a folder that every machine sees.

Run the same command again and it resumes from the newest OUT/checkpoint-<step> (a new --out starts
afresh; changed settings are refused, another --epochs or --max-steps too unless --new-schedule; another
number of processes goes on, saying what changes). SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 each
save a checkpoint within two steps and exit 0, whenever they come.
"""

from __future__ import annotations

import signal
import time

STARTED = time.monotonic()  # this process's start: how much of a Slurm attempt its start-up took

# A stop signal only sets this flag; training acts on it at the next step. Installed before anything
# else: a signal during the seconds of `import torch` must not kill the process either.
#   SIGTERM  Slurm's warning, torchrun passing its own SIGTERM or SIGINT on, `kill`
#   SIGINT   Ctrl-C (the terminal sends it to torchrun, which passes it on: its processes run in
#            sessions of their own; without torchrun, to this process and its loader workers)
#   SIGUSR1  the sbatch's "time limit near": save, stop, and the job requeues itself
#   SIGUSR2  the sbatch's "save and stop" (`scancel --signal=USR2 JOB`, with or without --batch)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
# What each means here, for the log line of the save. (A process cannot tell who sent a signal: the
# sbatch's time-limit warning and a `scancel --signal=USR1` are the same SIGUSR1.)
STOP_MEANING = {"SIGTERM": "kill, scancel, or torchrun passing its own on", "SIGINT": "Ctrl-C",
                "SIGUSR1": "the sbatch's time-limit warning, or scancel --signal=USR1: save and requeue",
                "SIGUSR2": "scancel --signal=USR2: save and stop"}
STOP_REQUESTED = 0  # 0: go on; 1: save and stop; 2: save and stop, then requeue (SIGUSR1)
STOP_SIGNAL = None  # the name of the first stop signal this process got


def request_stop(signum, frame) -> None:
    global STOP_REQUESTED, STOP_SIGNAL
    STOP_REQUESTED = max(STOP_REQUESTED, 2 if signum == getattr(signal, "SIGUSR1", None) else 1)
    STOP_SIGNAL = STOP_SIGNAL or signal.Signals(signum).name  # acted on at the next step boundary


def catch_stop_signals(handler=request_stop) -> None:
    for name in STOP_SIGNALS:
        if hasattr(signal, name):  # (Windows has no SIGUSR1/SIGUSR2)
            signal.signal(getattr(signal, name), handler)


if __name__ == "__main__":
    catch_stop_signals()

import argparse  # noqa: E402 - after the handler above
import ctypes  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
import zipfile  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, Subset,  # noqa: E402
                              default_collate, get_worker_info)
from tqdm import tqdm  # noqa: E402

log = logging.getLogger("train_ddp")


# === What you replace: data, model, loss, metrics, optimizer (template/README.md has the table) =====


class Digits(Dataset):
    """scikit-learn's 8x8 handwritten digits (no download), with a light random shift and noise.

    The augmentation is drawn from (seed, epoch, index) only: the same for any number of processes
    or loader workers, and a resumed run redoes a sample exactly as the first run did. The training
    loop sets `.epoch` before each epoch (set_epoch: also through Subset and random_split's pieces)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool, seed: int):
        self.images, self.labels, self.augment, self.seed, self.epoch = images, labels, augment, seed, 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if self.augment:
            g = torch.Generator().manual_seed((self.seed * 1_000 + self.epoch) * 1_000_000 + i)
            dy, dx = torch.randint(-1, 2, (2,), generator=g).tolist()
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
            image = image + 0.05 * torch.randn(image.shape, generator=g)
        return image, self.labels[i]


def build_datasets(seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation): the same split on every process (it comes from a fixed seed). Either may
    be a map-style Dataset (any, wrapped in Subset too) or, for training, an IterableDataset with a
    len() (see RankStream)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    val, train = order[:360], order[360:]
    return (Digits(images[train], labels[train], augment=True, seed=seed),
            Digits(images[val], labels[val], augment=False, seed=seed))


class ConvBlock(nn.Sequential):
    """Convolution, BatchNorm, ReLU: the unit that --fsdp shards on its own (fsdp_blocks)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


def build_model() -> nn.Module:
    return nn.Sequential(ConvBlock(1, 16), ConvBlock(16, 32), nn.MaxPool2d(2), ConvBlock(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """--fsdp: the submodules sharded one by one (each is all-gathered just before its forward and
    freed after it), in the order the forward uses them; the rest is sharded with the whole model.
    A transformer: its layers, e.g. `list(model.layers)`."""
    return [m for m in model.modules() if isinstance(m, ConvBlock)]


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The training loss; evaluate() calls it with reduction="sum". A language model's (B, T, V)
    logits: F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction=reduction), with
    padded targets set to -100 (cross_entropy's ignore_index) so that they count for nothing."""
    return F.cross_entropy(outputs, targets, reduction=reduction)


def metric_sums(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over one validation batch that add up over batches and ranks; evaluate() divides each by
    the total "count" (samples, tokens or pixels: whatever one target is; with padding, the real
    ones only: `(targets != -100).sum()`). Here: accuracy for any outputs whose dimension 1 holds
    the classes, one label per sample or per pixel."""
    return {"loss": loss_fn(outputs.float(), targets, reduction="sum"),
            "accuracy": (outputs.argmax(1) == targets).sum(), "count": torch.tensor(targets.numel())}


def collate(samples: list):
    """One batch from a list of samples (the DataLoader's collate_fn, in training and evaluation).
    default_collate stacks tensors of one shape; sequences of different lengths need padding to the
    longest in each batch, e.g. with their lengths for the model:
        tokens = [x for x, _ in samples]
        padded = nn.utils.rnn.pad_sequence(tokens, batch_first=True)  # pads with 0
        return (padded, torch.tensor([len(x) for x in tokens])), torch.stack([y for _, y in samples])
    (token targets of a language model: pad them with -100, `padding_value=-100`)"""
    return default_collate(samples)


def split_batch(batch) -> tuple:
    """(inputs, targets) from what the DataLoader gives: a (inputs, targets) pair here; for batches
    that are dicts, e.g. return batch["input_ids"], batch["labels"]. Inputs may be a tensor, or a
    dict or tuple of tensors that the model takes as one argument."""
    inputs, targets = batch
    return inputs, targets


# The validation metric that picks best.pt, and its direction (a language model: "loss", False).
BEST_METRIC, HIGHER_IS_BETTER = "accuracy", True


def build_optimizer(model: nn.Module, args: argparse.Namespace, total_steps: int):
    """(optimizer, scheduler). The scheduler steps once per optimizer step; a ReduceLROnPlateau instead
    steps after each validation, with its BEST_METRIC (mode="max" where HIGHER_IS_BETTER). Its state
    is saved in every checkpoint and restored."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(1, total_steps))
    return optimizer, scheduler


# === Everything below works as is ===================================================================
# Distributed setup (attempt_store, setup_distributed); data sharding (set_epoch, ResumableSampler,
# RankStream); checkpoints (DDP: one file; FSDP: a DCP folder); evaluation; signals and loader
# workers; main() with the training loop.


# --- Distributed setup: everything about processes and devices, in one place ---------------------


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A key-value store that only this attempt's processes use, for init_process_group.

    A plain launch starts a new store each time. But across restarts, torchrun keeps ONE store for
    the whole job (TORCHELASTIC_USE_AGENT_STORE), and the processes of a crashed attempt leave their
    keys and addresses in it: a restarted rank could read a dead address. Numbering the attempts does
    not work: torchrun's own count (TORCHELASTIC_RESTART_COUNT) differs between machines, and a count
    of the processes that joined goes wrong for good once a process dies before joining. So rank 0
    starts a store of this attempt's own on a free port and posts the port in the job's store; a rank
    that reads a dead attempt's port cannot connect to it, and reads again."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    job_store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:  # rank 0 runs on the machine that hosts the job's store (MASTER_ADDR)
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        job_store.set("train_ddp/attempt_store_port", str(own.port))
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        own_port = int(job_store.get("train_ddp/attempt_store_port"))  # waits until rank 0 posted one
        try:  # a plain connection first: TCPStore would print pages of C++ errors for a dead port
            socket.create_connection((host, own_port), timeout=5).close()
            return dist.TCPStore(host, own_port, world_size, is_master=False, timeout=timeout)
        except OSError:  # a dead attempt's port: rank 0 of this attempt has not posted yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def setup_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Join torchrun's process group; return (rank, world_size, device).

    nccl with one GPU per process (chosen by LOCAL_RANK) where there is an accelerator, else gloo
    on the CPU. Also works without torchrun (one process)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain `python train_ddp.py`: a group of one
    os.environ.setdefault("MASTER_PORT", "29500")
    if hasattr(torch, "accelerator"):  # torch >= 2.6: CUDA, ROCm, XPU, MPS, ... alike
        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    else:
        accel = torch.device("cuda") if torch.cuda.is_available() else None
    if accel is not None and accel.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before anything touches the GPU: else every rank uses cuda:0
        backend = "nccl"
    else:  # (another accelerator: put its backend here, e.g. "xccl" for XPU)
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = attempt_store(rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    return rank, world_size, device


# --- Data: which samples each process takes, and where a resumed run goes on ------------------------


def set_epoch(dataset, epoch: int) -> None:
    """Tell a dataset the epoch (for augmentation drawn from (seed, epoch, index)): calls its
    set_epoch(epoch) if it has one, else sets `.epoch` if it has that attribute; and the same for
    every dataset it wraps (`Subset.dataset`, as random_split gives, `ConcatDataset.datasets`), so
    that a wrapped dataset's augmentation changes every epoch too."""
    if callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(epoch)
    elif hasattr(dataset, "epoch"):
        dataset.epoch = epoch
    for inner in [getattr(dataset, "dataset", None), *getattr(dataset, "datasets", [])]:
        if isinstance(inner, (Dataset, IterableDataset)):
            set_epoch(inner, epoch)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can skip the first `skip` samples of this rank's epoch.

    Resuming mid-epoch this way never loads the skipped samples. Rank r takes samples r, r + W,
    r + 2W, ... of the epoch's shuffled order: after k batches, the ranks together have taken the
    first k x W x batch samples, at any number of processes W (what a resize goes on from)."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


class RankStream(IterableDataset):
    """This process's share of an IterableDataset (a stream), for DataLoader workers.

    The stream must give the same samples in the same order on every process (an epoch's order may
    depend on `.epoch`, which set_epoch sets) and have a len(): the samples in an epoch. Rank r
    takes samples r, r + W, ... (the first len // W of them, the same count on every rank), skips
    the `skip` it took before a resume, and loader worker w of n yields batches w, w + n, ...: the
    DataLoader returns the batches in order, the same at any number of workers. Every rank and
    worker reads the whole stream and keeps its part; a stream of files can shard itself instead:
    `rank`, `world_size` and `skip` are here to read."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, batch_size: int):
        self.dataset, self.rank, self.world_size, self.batch_size, self.skip = dataset, rank, world_size, batch_size, 0
        self.per_rank = len(dataset) // world_size

    def __len__(self) -> int:
        return self.per_rank - self.skip

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = itertools.islice(iter(self.dataset), self.rank, self.per_rank * self.world_size, self.world_size)
        mine = itertools.islice(mine, self.skip, None)
        for b in itertools.count():
            batch = list(itertools.islice(mine, self.batch_size))
            if len(batch) < self.batch_size:  # (the last part batch is dropped, as drop_last does)
                return
            if b % workers == worker:
                yield from batch


# --- Checkpoints: OUT/checkpoint-<step>.pt (DDP) or OUT/checkpoint-<step>/ (FSDP, DCP) --------------
# Written to a temporary name and renamed: a checkpoint under its final name is whole. The newest
# --keep readable ones are kept; a resume loads the newest that reads.

PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau  # steps with a validation metric, not per step
TRAIN_STATE = "train_state.pt"  # in a DCP folder: step, RNGs, settings (the tensors are DCP's shards)


def save_atomic(obj, path: Path) -> None:
    """Write to a temporary file, then rename: a crash mid-save leaves the previous file intact."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _READABLE.add(path)


def save_sharded(net: nn.Module, optimizer, train_state: dict, path: Path, is_main: bool) -> None:
    """--fsdp: a DCP checkpoint folder. Every rank writes its own shards of the model and optimizer
    (torch.distributed.checkpoint) into OUT/.checkpoint-<step>.tmp/; rank 0 adds train_state.pt and
    SHA256SUMS (write_checksums) and renames the folder once every rank has written (dcp.save
    returns on every rank after that)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(f".{path.name}.tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(net, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
    if is_main:
        save_atomic(train_state, tmp / TRAIN_STATE)
    write_checksums(tmp, is_main)
    if is_main:
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        _READABLE.add(path)


# In a DCP folder: every file's SHA-256, written at the save, checked before a load. A shard with
# other bytes of the same length (a bad disk, a copy gone wrong) loads without a word, or fails deep
# in DCP on every rank; the checksums find it first. By hand: `cd OUT/checkpoint-<step> && sha256sum -c SHA256SUMS`.
CHECKSUMS = "SHA256SUMS"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(folder: Path, is_main: bool) -> None:
    """Every rank hashes its share of the folder's shard files (in parallel), rank 0 writes them all
    to folder/SHA256SUMS with .metadata's and train_state.pt's (the format `sha256sum -c` reads)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = sorted(p.name for p in folder.glob("*.distcp"))
    mine = {name: file_sha256(folder / name) for name in names[rank::world_size]}
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if is_main:
        sums = {name: digest for part in every for name, digest in part.items()}
        for name in (".metadata", TRAIN_STATE):
            if (folder / name).exists():
                sums[name] = file_sha256(folder / name)
        with open(folder / CHECKSUMS, "w") as f:
            f.writelines(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
            f.flush()
            os.fsync(f.fileno())


def checksum_problem(folder: Path) -> str | None:
    """Why a DCP folder's files differ from the SHA256SUMS written at its save, or None (also for a
    folder without one, from an earlier version of this script). Every rank checks its share of the
    files, in parallel; every rank gets the same answer."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    problem = None
    if (folder / CHECKSUMS).exists():
        lines = (line.split(None, 1) for line in (folder / CHECKSUMS).read_text().splitlines())
        sums = {name: digest for digest, name in lines}
        for name in sorted(sums)[rank::world_size]:
            if not (folder / name).is_file():
                problem = f"{name} is missing"
            elif file_sha256(folder / name) != sums[name]:
                problem = f"{name}'s SHA-256 differs from the one written at the save (other bytes)"
            if problem:
                break
    every = [None] * world_size
    dist.all_gather_object(every, problem)
    return next((p for p in every if p), None)


def load_sharded(net: nn.Module, optimizer, path: Path) -> str | None:
    """Each rank reads its shards of a DCP checkpoint: at the same number of processes or another
    (DCP reshards). Returns None, or why it could not be read (the same on every rank: the files'
    checksums, or an error of any rank's dcp.load), in one line; the model and optimizer are then
    half-loaded, and the caller loads another checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    problem = checksum_problem(path)
    if problem:
        return problem
    try:
        model_state, optimizer_state = get_state_dict(net, optimizer)  # (the optimizer's state made first)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - CheckpointException is a BaseException
        problem = one_line(error)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)  # (DCP raises on every rank when one fails; this makes sure)
    return next((p for p in every if p), None)


def one_line(error: BaseException) -> str:
    """An error in one line: its type and last line; for DCP's CheckpointException (every failed
    rank's traceback, hundreds of lines), the first failed rank's error."""
    failures = getattr(error, "failures", None)
    if failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {one_line(inner)}"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def dcp_metadata(path: Path):
    """A DCP folder's .metadata: every tensor's name and shape, and where its bytes are."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def cut_shard(path: Path) -> str | None:
    """Why a DCP folder's shard files are not whole, or None: .metadata says which file holds each
    tensor and at which offset and length; a file that is missing or shorter (cut off by a full disk,
    a copy that stopped) is found here, before dcp.load would fail on it on every rank."""
    ends: dict[str, int] = {}
    for info in (dcp_metadata(path).storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            return f"{name} is missing" if size is None else f"{name} is cut off ({size} of {end} bytes)"
    return None


CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)(\.pt)?")  # checkpoint-0000040.pt (DDP), checkpoint-0000040/ (FSDP)


def checkpoint_step(path: Path) -> int:
    return int(CHECKPOINT_NAME.fullmatch(path.name).group(1))


def checkpoints(out: Path) -> list[Path]:
    """OUT/checkpoint-<step>.pt and OUT/checkpoint-<step>/, newest first. Nothing else counts: a
    folder you named checkpoint-old (or checkpoint-0000040-bad, to set one aside) is left alone."""
    found = []
    for path in out.glob("checkpoint-*"):
        name = CHECKPOINT_NAME.fullmatch(path.name)
        if name and (path.is_file() if name.group(2) else path.is_dir()):
            found.append(path)
    return sorted(found, key=checkpoint_step, reverse=True)


def load_train_state(path: Path, device: torch.device) -> dict:
    """A checkpoint file, or a DCP folder's train_state.pt (its shards are loaded later, by every
    rank: here only checked to be whole). torch.load does not check the zip archive's CRCs (other
    bytes in a tensor load silently): checked here first."""
    file = path / TRAIN_STATE if path.is_dir() else path
    if path.is_dir() and not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path / '.metadata'} is missing")
    if zipfile.is_zipfile(file):
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()  # reads every member, compares its CRC-32
        if bad is not None:
            raise OSError(f"{bad} in {file.name} has other bytes than were written (its CRC-32 differs)")
    state = torch.load(file, map_location=device, weights_only=True)
    problem = cut_shard(path) if path.is_dir() else None
    if problem:
        raise OSError(problem)
    return state


def saved_shapes(path: Path, state: dict) -> dict[str, tuple | None]:
    """The names and shapes of the model's tensors in a checkpoint: a DDP file's "model", or what a
    DCP folder's .metadata says of its "model." entries (no shard is read)."""
    if not path.is_dir():
        return shapes_of(state["model"])
    entries = dcp_metadata(path).state_dict_metadata
    return {k.removeprefix("model."): tuple(m.size) if hasattr(m, "size") else None
            for k, m in entries.items() if k.startswith("model.")}


def newest_loadable_checkpoint(out: Path, device: torch.device, skip: set[Path] = frozenset()
                               ) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; one that does not (cut off by a full disk, say), or one in
    `skip` (its shards failed to load), is skipped with a warning and the one before it is used.
    None when there is none at all; when there are some but none loads, refuse (starting from step 0
    would throw the run away silently)."""
    found = checkpoints(out)
    for path in found:
        if path in skip:
            continue
        try:
            return path, load_train_state(path, device)
        except Exception as error:  # noqa: BLE001 - any unreadable file: try the one before
            log.warning("%s cannot be read (%s: %s): trying the checkpoint before it", path,
                        type(error).__name__, str(error).splitlines()[0][:200])
    if found:
        raise CheckpointError(f"{out} has {len(found)} checkpoint(s) and none can be read: move them away "
                              f"to start from step 0, or resume from a copy that reads")
    return None


class CheckpointError(Exception):
    """Checkpoints exist, but none can be read."""


_READABLE: set[Path] = set()  # checkpoints this process wrote, or found readable once
_UNREADABLE: set[Path] = set()  # checkpoints whose shards failed to load (checksums, dcp.load)


def readable(path: Path) -> bool:
    """Whether a checkpoint is whole: torch.save writes a zip archive, and every member's CRC must
    match (reads the file, unpickles nothing); a DCP folder needs its .metadata, a whole
    train_state.pt (renamed into place only after every shard was written) and every shard file as
    long as .metadata says. Each is checked once."""
    if path in _READABLE:
        return True
    if path in _UNREADABLE:
        return False
    file = path / TRAIN_STATE if path.is_dir() else path
    try:
        with zipfile.ZipFile(file) as archive:
            whole = archive.testzip() is None
    except (OSError, zipfile.BadZipFile):
        whole = False
    if whole and path.is_dir():
        try:
            whole = cut_shard(path) is None
        except Exception:  # noqa: BLE001 - no .metadata, or one that does not unpickle
            whole = False
    if whole:
        _READABLE.add(path)
    return whole


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune_checkpoints(out: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints that can be read; delete the others, unreadable ones too
    (counting a cut-off file as kept would delete the good ones it replaced)."""
    kept = 0
    for path in checkpoints(out):
        if kept < keep and readable(path):
            kept += 1
        else:
            remove(path)
            _READABLE.discard(path)


# --- Small helpers --------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def shapes_of(state: dict) -> dict[str, tuple | None]:
    """Each tensor's shape (a DTensor's: the whole tensor's) in a state_dict; None for other values."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def model_mismatch(expected: dict[str, tuple | None], found: dict[str, tuple | None]) -> str | None:
    """How weights of names and shapes `found` do not fit a model of `expected`, in a few words
    (a count and a first example of each kind); None when they fit."""
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    other = [f"{k} is {found[k]}, the model's {expected[k]}" for k in expected
             if k in found and None not in (found[k], expected[k]) and found[k] != expected[k]]
    parts = [f"{len(names)} {what} (e.g. {names[0]})" for names, what in (
        (missing, "of the model's tensors missing"), (extra, "tensors the model does not have"),
        (other, "of another shape"))
        if names]
    return "; ".join(parts) or None


def load_pretrained(model: nn.Module, path: str) -> None:
    """Weights from a file: a state_dict, or a checkpoint with a "model" entry.

    Keys saved from a DDP-wrapped model start with "module.": that prefix (and only a prefix) is
    removed. weights_only=True: the file can hold tensors and plain containers, never code. Weights
    of another model are refused in one line (strict: no tensor is skipped silently)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    problem = model_mismatch(shapes_of(model.state_dict()), shapes_of(state))
    if problem:
        raise SystemExit(f"--pretrained {path} holds another model's weights: {problem}. Give weights of "
                         f"the model that build_model() makes")
    model.load_state_dict(state)


def to_device(x, device: torch.device):
    """Tensors, and dicts, lists and tuples of them, moved to `device` (asynchronously from pinned memory)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def peak_memory_mib(device: torch.device) -> float | None:
    """The most memory this process has held so far, in MiB: on a GPU the tensors' peak
    (torch.cuda.max_memory_allocated), on the CPU the peak resident set (getrusage), which counts
    everything the process touched. On the CPU, glibc keeps freed memory in the process unless
    MALLOC_MMAP_THRESHOLD_ is set (e.g. =1048576): without it FSDP's freed gathers stay counted."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # (Windows)
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024)


def write_metrics(path: Path, record: dict, board=None) -> None:
    """One JSON line per record (read back with pandas.read_json(path, lines=True)); to TensorBoard
    too when `board` is a SummaryWriter."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if board is not None:
        group = "validation" if "validation" in record else "train"
        for name, value in record.get("validation", record).items():
            if name not in ("step", "epoch", "count") and value is not None:
                board.add_scalar(f"{group}/{name}", value, record["step"])
        board.flush()


def drop_rows_after(path: Path, step: int) -> None:
    """Remove the rows of steps after `step` (written after the checkpoint a run resumes from: it
    writes them again), so that metrics.jsonl has one row per step and kind."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut off by a crash mid-write
            pass
    if kept != lines:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def tensorboard_writer(out: Path, purge_step: int | None = None):
    """A SummaryWriter on OUT/tensorboard where the tensorboard package is installed, else None.
    purge_step: TensorBoard hides the events at and after it from an earlier attempt."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard needs `pip install tensorboard`
        return None
    return SummaryWriter(str(out / "tensorboard"), purge_step=purge_step or None)


def settle_bucket_order(model: DDP, batch) -> None:
    """A forward and backward that change nothing, so that DDP fixes its gradient buckets now.

    After the first backward, DDP re-orders its buckets to the order in which gradients got ready.
    That moves gradients to other places in the all-reduce, and with 3 or more ranks the sums then
    round differently in the last bit: a resumed run would drift from an uninterrupted one. Doing it
    here, in every run, makes every real step use the same buckets. (eval(): BatchNorm's running
    statistics stay as they are and dropout draws nothing. cuDNN off for this pass: cuDNN's GRU and
    LSTM refuse a backward in eval mode; PyTorch's own kernels do it.)"""
    inputs, targets = to_device(split_batch(batch), next(model.parameters()).device)
    model.eval()
    with torch.backends.cudnn.flags(enabled=False):
        loss_fn(model(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    model.train()


def checkpoint_activations(net: nn.Module) -> None:
    """--activation-checkpointing: each of fsdp_blocks(net) keeps only its input for the backward
    and runs its forward again there (torch.utils.checkpoint, use_reentrant=False), so that one
    block's activations at a time are alive in the backward, not every block's: less memory for
    about one more forward of compute. The recomputation draws the same random numbers (dropout)
    as the forward did, so the results are bit for bit those without it. Before DDP or fully_shard
    (which, in the backward, gathers a block's parameters before its recomputation needs them).
    BatchNorm refused: recomputed, it would update its running statistics a second time."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for block in fsdp_blocks(net):
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in block.modules()):
            raise SystemExit(f"--activation-checkpointing: a block of fsdp_blocks(model) ({type(block).__name__}) "
                             f"has BatchNorm, whose running statistics the recomputation would update twice; "
                             f"use it with blocks without BatchNorm (a transformer's layers)")
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def shard_model(net: nn.Module, param_dtype: torch.dtype | None) -> nn.Module:
    """--fsdp: FSDP2 (fully_shard) on each of fsdp_blocks(net), then on the whole model. Parameters
    in `param_dtype` for the forward and backward (bf16 with --amp), gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32 if param_dtype is not None else None)
    for block in fsdp_blocks(net):
        fully_shard(block, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    return net


def build_sharded_model(device: torch.device, param_dtype: torch.dtype | None, pretrained: str | None,
                        sync_bn: bool, compile: bool, activation_checkpointing: bool = False) -> nn.Module:
    """--fsdp: a model whose weights need not fit one device. Every process builds it on the meta
    device (shapes, no memory), shards it and allocates only its own shards (`to_empty`). Rank 0
    alone builds it for real, on the CPU (the larger memory), with --pretrained's weights, and sends
    it tensor by tensor; each process keeps its shard of each (`set_model_state_dict(...,
    broadcast_from_rank0=True)`). So a process holds its shards plus one whole tensor at a time, and
    the initial weights are those that `build_model()` makes without --fsdp, bit for bit."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full, refused = None, None
    if dist.get_rank() == 0:
        full = build_model()
        if pretrained:
            try:
                load_pretrained(full, pretrained)
            except SystemExit as error:  # said on every process, or the others would wait for rank 0
                refused = str(error)
    # Every process's random stream goes on as if it had built the model itself (the seed is the same).
    after_build = [torch.get_rng_state(), refused]
    dist.broadcast_object_list(after_build)
    if after_build[1]:
        raise SystemExit(after_build[1])
    torch.set_rng_state(after_build[0])
    with torch.device("meta"):
        net = build_model()
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    if activation_checkpointing:
        checkpoint_activations(net)
    if compile:
        net.compile()
    shard_model(net, param_dtype)
    net.to_empty(device=device)
    set_model_state_dict(net, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state_dict (persistent=False, e.g. a rotary embedding's table) come from rank 0 too.
    kept = set(net.state_dict())
    made = dict(full.named_buffers()) if full is not None else {}
    for name, buffer in net.named_buffers():
        if name not in kept:
            if full is not None:
                buffer.copy_(made[name])
            dist.broadcast(buffer, 0)
    del full
    return net


def full_state_dict(net: nn.Module, fsdp: bool) -> dict:
    """The whole model's state_dict on rank 0, on the CPU (with --fsdp every rank must call this:
    the shards are gathered, and rank 0 holds the whole model; the other ranks get {}). The script
    itself saves weights without it (save_weights)."""
    if not fsdp:
        return net.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def model_weights(net: nn.Module, fsdp: bool) -> dict:
    """The model's state_dict as it is: with --fsdp each parameter a DTensor (this rank's shard of it)."""
    if not fsdp:
        return net.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(net)


def save_weights(weights: dict, path: Path, fsdp: bool, is_main: bool, extra: dict | None = None) -> Path:
    """Weights for use outside training (best, final): the state_dict, or {"model": it, **extra}.
    DDP: the file `path` (OUT/final.pt), from rank 0. --fsdp: the folder OUT/final/ (DCP), each rank
    writing its own shards, so that no rank holds the whole model; one process makes it the same
    file as DDP's (torch.distributed.checkpoint.format_utils.dcp_to_torch_save):
        python -m torch.distributed.checkpoint.format_utils dcp_to_torch OUT/final OUT/final.pt
    Written under a temporary name and renamed. Returns the file or folder."""
    state = {"model": weights, **extra} if extra else weights
    if not fsdp:
        if is_main:
            save_atomic(state, path)
        return path
    import torch.distributed.checkpoint as dcp

    folder = path.with_suffix("")
    tmp = folder.with_name(f".{folder.name}.tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    write_checksums(tmp, is_main)
    if is_main:
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    return folder


def weights_sha256(state: dict) -> str:
    """A fingerprint of every parameter and buffer: equal fingerprints, bit-identical weights. A
    sharded state_dict (--fsdp: DTensors) too, on every rank at once: each tensor is gathered in
    turn and freed, so no rank holds more than one whole tensor; the digest is the whole model's."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        if hasattr(t, "full_tensor"):  # (a collective: every rank, in the same order)
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def broadcast_buffers(net: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, as DDP does before each
    forward. FSDP does not: each rank would keep its own, and a checkpoint holds only one rank's."""
    for buffer in net.buffers():
        dist.broadcast(buffer, 0)


# --- Evaluation: every validation sample counted exactly once --------------------------------------


@torch.no_grad()
def evaluate(net: nn.Module, val_set: Dataset, rank: int, world_size: int, device: torch.device,
             args: argparse.Namespace, amp_dtype, lockstep: bool = False) -> dict:
    """Exact metrics over the validation set (metric_sums, added over every batch and rank, each
    divided by the total count); each rank takes indices rank, rank + W, ...

    (DistributedSampler would pad the last round with duplicates.) Takes the bare network, not the
    DDP wrapper: ranks may run different numbers of batches, and DDP's forward talks to the others.
    lockstep (FSDP, whose forward all-gathers): every rank runs as many forwards as rank 0, the
    ranks with fewer batches on a spare one whose outputs count for nothing."""
    was_training = net.training
    net.eval()
    # Rank 0's buffers (BatchNorm's running statistics) on every rank, as DDP's forward uses them
    # (broadcast_buffers) and as final.pt holds them: each rank's own would make the result depend on
    # the number of processes. (Training is unchanged: DDP broadcasts them again at its next forward.)
    broadcast_buffers(net)
    mine = Subset(val_set, range(rank, len(val_set), world_size))
    loader = DataLoader(mine, batch_size=args.batch_size, num_workers=0, pin_memory=device.type == "cuda",
                        collate_fn=collate,
                        generator=torch.Generator())  # its own: iterating must not move the global generator
    autocast = torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                              enabled=amp_dtype is not None and not lockstep)
    totals: dict[str, torch.Tensor] = {}
    for batch in loader:
        inputs, targets = to_device(split_batch(batch), device)
        with autocast:
            outputs = net(inputs)
        for name, value in metric_sums(outputs, targets).items():
            totals[name] = totals.get(name, 0) + value.detach().double().to(device)
    if lockstep:
        most = -(-len(range(0, len(val_set), world_size)) // args.batch_size)  # rank 0's batches
        spare, _ = to_device(split_batch(collate([val_set[0]])), device)
        for _ in range(most - len(loader)):
            net(spare)
    names = sorted(totals)  # the same order on every rank (main() checks that each rank has a sample)
    sums = torch.stack([totals[n] for n in names])
    dist.all_reduce(sums)
    net.train(was_training)
    total = dict(zip(names, sums.tolist()))
    count = total.pop("count")
    return {**{n: v / count for n, v in total.items()}, "count": int(count)}


# --- Settings ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="DDP or FSDP training with torchrun (see the docstring for commands)")
    p.add_argument("--out", default="runs/train_ddp", help="checkpoints and results (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=10,
                   help="passes over the training set; the learning-rate schedule spans them (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="at most this many optimizer steps in all (the schedule spans these instead)")
    p.add_argument("--new-schedule", action="store_true",
                   help="on a resume with other --epochs or --max-steps: rebuild the learning-rate schedule "
                        "for the new total (the rate jumps); without it such a resume is refused")
    p.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.1,
                   help="the peak learning rate of the one-cycle schedule (default: %(default)s)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm; 0: no clipping")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 instead of DDP: parameters, gradients and optimizer state sharded over the "
                        "processes (fully_shard per fsdp_blocks), sharded DCP checkpoints")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations (fsdp_blocks) in the backward instead of keeping "
                        "them: less memory, about one more forward of compute; bit for bit the same results "
                        "(not for blocks with BatchNorm)")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="auto: bf16 on GPUs that run it natively (Ampere+), else fp16 + GradScaler (with --fsdp: "
                        "off); off on the CPU")
    p.add_argument("--sync-bn", action="store_true",
                   help="BatchNorm statistics over all processes (nccl only: gloo has no SyncBatchNorm)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the network (in place: checkpoints keep their keys); minutes of compiling first")
    p.add_argument("--tf32", action="store_true",
                   help="float32 matrix products on TF32 tensor cores (Ampere+ GPUs): faster, ~3 digits fewer")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights, data order, augmentation and dropout (default: %(default)s)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="on GPUs, cuDNN's deterministic algorithms: bit-exact resumes; --no-deterministic "
                        "lets cuDNN pick the fastest (benchmark), which may differ run to run")
    p.add_argument("--checkpoint-every", type=int, default=50, help="optimizer steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=0, help="optimizer steps between validations (0: at each epoch's end)")
    p.add_argument("--keep", type=int, default=2, help="how many checkpoints to keep (a corrupt newest falls back)")
    p.add_argument("--log-every", type=int, default=20,
                   help="optimizer steps between log lines (loss, rate, ETA: progress in a Slurm log too)")
    p.add_argument("--timeout-s", type=float, default=600,
                   help="how long a collective may wait for the other ranks before failing")
    p.add_argument("--pretrained", default=None, help="initial weights (ignored when resuming)")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="start from this checkpoint (a checkpoint-<step>.pt file, or a checkpoint-<step>/ folder "
                        "with --fsdp), e.g. another run's, while --out has none of its own; once it has, a "
                        "restart or requeue of the same command goes on from --out's newest")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# Settings a resume must keep: they change the arithmetic of the steps still to come. (Other --epochs
# or --max-steps change the schedule's length: refused unless --new-schedule. Another number of
# processes goes on: the global batch and the batches' make-up change, said in one line.)
KEPT_ON_RESUME = ("seed", "lr", "clip_grad", "amp", "sync_bn", "fsdp")


def resume_problems(saved: dict, args: argparse.Namespace, world_size: int,
                    total_steps: int | None = None) -> list[str]:
    """Why a checkpoint written with settings `saved` cannot go on with these; [] if it can. At
    another number of processes than the checkpoint's, the global batch and the schedule's length
    may change (main() says how); at the same number, they must stay."""
    problems = [f"--{k.replace('_', '-')} was {saved.get(k, False)}, now {getattr(args, k)}"
                for k in KEPT_ON_RESUME if (k in saved or k == "fsdp") and saved.get(k, False) != getattr(args, k)]
    if saved.get("world_size", world_size) != world_size:
        return problems
    global_batch = world_size * args.batch_size * args.accum
    if "global_batch" in saved and saved["global_batch"] != global_batch:
        advice = (f"resume with --batch-size {saved['batch_size']} --accum {saved['accum']}"
                  if "batch_size" in saved else "resume with the old --batch-size and --accum")
        problems.append(f"the global batch (processes x --batch-size x --accum) was {saved['global_batch']}, "
                        f"now {global_batch} ({advice})")
    schedule = saved.get("schedule_steps")
    if total_steps is not None and schedule is not None and schedule != total_steps and not args.new_schedule:
        problems.append(f"the learning-rate schedule spans {schedule} steps, and --epochs/--max-steps now make "
                        f"{total_steps} (resume with the old values, or add --new-schedule to rebuild it for "
                        f"{total_steps}: the learning rate then jumps)")
    return problems


def ensure_writable(out: Path) -> None:
    """Refuse an output folder that cannot be written now, not after the first epoch's training."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise SystemExit(f"--out {out}: cannot write there ({error.strerror or error}); "
                         f"choose a folder you can write to") from None


def pick_amp(choice: str, device: torch.device, fsdp: bool = False) -> torch.dtype | None:
    """The autocast dtype (with --fsdp: the parameters' dtype in the forward), or None for float32."""
    if choice == "auto":
        if device.type != "cuda":
            return None  # CPUs without 16-bit units run autocast several times slower
        # including_emulation=False: by default is_bf16_supported() also says True on a V100 or T4,
        # which only emulate bf16 (torch/cuda/__init__.py); native bf16 needs compute capability 8.0+
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native_bf16 else None if fsdp else torch.float16
    if choice == "fp16" and fsdp:
        raise SystemExit("--amp fp16 with --fsdp needs a sharded GradScaler, which this template does not "
                         "have: use --amp bf16 (Ampere+ GPUs) or --amp off")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[choice]


TRAINER_PID = os.getpid()  # (set again in main(); forked DataLoader workers inherit it)


def worker_init(worker_id: int) -> None:
    """First thing in every DataLoader worker. Slurm and a terminal's Ctrl-C (without torchrun) signal
    every process, and a worker killed by a signal makes the training process raise before it can save;
    so workers ignore the stop signals. They are forked with these blocked (start_workers): one that
    arrived since is still pending, and SIG_IGN discards it before the unblock. And a worker dies
    with its training process (Linux: PR_SET_PDEATHSIG), even one killed with SIGKILL, instead of
    lingering for seconds."""
    catch_stop_signals(signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # (POSIX; Windows has no signal masks)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals())
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != TRAINER_PID:  # it died before prctl: no signal would come
            os._exit(0)


def stop_signals() -> set:
    return {getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)}


def start_workers(loader: DataLoader):
    """iter(loader), with the stop signals blocked while it forks the workers (they inherit them
    blocked until worker_init ignores them). PyTorch's own handlers, installed in a worker before
    worker_init runs, would otherwise let a signal in that window kill it. This process receives a
    signal that arrived meanwhile as soon as it is unblocked."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (and no fork)
        return iter(loader)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals())
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


# Testing only: the course's tests set RINGSIDE_TEST_FAULTS (unset, nothing happens), e.g.
# "fail_at_step=-1,25 fail_rank=3 step_delay=0.3": rank fail_rank kills itself (SIGKILL) before each
# step of fail_at_step, once per --out (-1: before it joins the process group); every step sleeps
# step_delay seconds (a slow model), the start-up startup_delay (a slow start). Not options: nothing
# in --help.
FAULTS = dict(item.split("=", 1) for item in os.environ.get("RINGSIDE_TEST_FAULTS", "").split())


def fail_once_if_asked(out: Path, rank: int, step: int) -> None:
    """Testing: the crash that RINGSIDE_TEST_FAULTS asks for, once per --out (whatever restarts follow)."""
    if FAULTS and str(step) in FAULTS.get("fail_at_step", "").split(",") and rank == int(FAULTS.get("fail_rank", 0)):
        marker = out / f".failed_at_step_{step}"
        if not marker.exists():
            marker.touch()
            print(f"rank {rank}: killing myself (SIGKILL) before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


# OUT/.stopped, written at a signal's save, for the sbatch: "requeue" (SIGUSR1) or "stop", then this
# attempt's start-up and training seconds and its steps (the sbatch does not requeue an attempt that
# was mostly start-up: the next would be too).
STOPPED_MARKER = ".stopped"


def exit_now(code: int) -> None:
    """Flush and leave at once: gloo's threads can abort a normal interpreter exit ("terminate called
    without an active exception") or hang it, waiting on a peer that died."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- Training ----------------------------------------------------------------------------------------------


def choose_checkpoint(out: Path, args: argparse.Namespace, device: torch.device, is_main: bool,
                      skip: set[Path]) -> tuple[Path | None, dict | None]:
    """(the checkpoint to resume from, its train state) on every rank, or (None, None) to start
    afresh: OUT's newest that loads and is not in `skip`, or --resume while OUT has none. Rank 0
    chooses and tells the others; a refusal (none can be read) stops every rank in one line."""
    found, refused = None, None
    if is_main:
        try:
            if args.resume and not checkpoints(out):
                try:
                    found = Path(args.resume), load_train_state(Path(args.resume), device)
                except Exception as error:  # noqa: BLE001 - said in one line, on every rank
                    refused = f"--resume {args.resume} cannot be read ({one_line(error)})"
            else:
                if args.resume and not skip:
                    log.info("--resume %s not used: %s has checkpoints of its own, and goes on from its newest",
                             args.resume, out)
                found = newest_loadable_checkpoint(out, device, skip)
        except CheckpointError as error:
            refused = str(error)
    chosen = [str(found[0]) if found else None, refused]
    dist.broadcast_object_list(chosen)
    if chosen[1]:
        raise SystemExit(chosen[1])  # on every rank: none waits for the others
    if chosen[0] is None:
        return None, None
    ckpt = Path(chosen[0])
    # (FileNotFoundError on another machine: --out is not a folder that every machine sees)
    return ckpt, found[1] if is_main else load_train_state(ckpt, device)


def build_network(args: argparse.Namespace, device: torch.device, amp_dtype) -> tuple[nn.Module, nn.Module]:
    """(model, net): the network to train (DDP-wrapped, or sharded in place with --fsdp) and the bare
    network inside it, with --pretrained's weights, --sync-bn (nccl only) and --compile."""
    if args.sync_bn and device.type != "cuda":
        log.warning("--sync-bn needs nccl: on the CPU each rank keeps its own BatchNorm statistics")
    sync_bn = args.sync_bn and device.type == "cuda"
    if args.tf32:
        torch.set_float32_matmul_precision("high")  # (cuDNN's convolutions use TF32 by default already)
    if args.fsdp:  # built on the meta device, sharded, then filled from rank 0 (in place: model is net)
        net = build_sharded_model(device, amp_dtype, args.pretrained, sync_bn, args.compile,
                                  args.activation_checkpointing)
        return net, net
    net = build_model()
    if args.pretrained:
        load_pretrained(net, args.pretrained)
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net.to(device)
    if args.activation_checkpointing:
        checkpoint_activations(net)
    if args.compile:
        net.compile()  # nn.Module.compile: in place, so state_dict keys stay as they are
    return DDP(net, device_ids=[device.index] if device.type == "cuda" else None), net


@record  # an exception's traceback goes to torchrun's summary of the failed ranks
def main() -> None:
    try:
        train()
    except BaseException:
        # An error, or a peer that died (gloo: "Connection reset"): nothing is left to save. The stop
        # signals get their default action back, so that the SIGTERM torchrun sends every process
        # once one failed ends this one at once (caught, it would be waited out for torchrun's whole
        # shutdown timeout before the restart), and the process exits (exit_now) instead of waiting
        # on the dead peer in the interpreter's exit.
        catch_stop_signals(signal.SIG_DFL)
        raise


def train() -> None:
    args = parse_args()
    out = Path(args.out)
    ensure_writable(out)  # every process, before any waits for another
    for option, path in (("--pretrained", args.pretrained), ("--resume", args.resume)):
        if path and not Path(path).exists():  # every process says it and stops: none waits for another
            raise SystemExit(f"{option} {path}: no such file or folder")
    if FAULTS:  # (testing only) a start-up crash, a slow start-up
        fail_once_if_asked(out, int(os.environ.get("RANK", 0)), step=-1)
        time.sleep(float(FAULTS.get("startup_delay", 0)))
    rank, world_size, device = setup_distributed(args.timeout_s)
    is_main = rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
    catch_stop_signals()  # (set at import already when run as a script)
    global TRAINER_PID
    TRAINER_PID = os.getpid()
    amp_dtype = pick_amp(args.amp, device, args.fsdp)
    use_autocast = amp_dtype is not None and not args.fsdp  # FSDP: the parameters' dtype instead

    # Reproducible: the same seed gives the same initial weights, data order and augmentation.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":  # deterministic: bit-exact resumes; else cuDNN's fastest algorithms
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = args.deterministic, not args.deterministic

    train_set, val_set = build_datasets(args.seed)
    if len(val_set) < world_size:
        raise SystemExit(f"{len(val_set)} validation samples for {world_size} processes: each needs one at least")
    streaming = isinstance(train_set, IterableDataset)
    common = dict(batch_size=args.batch_size, drop_last=True, num_workers=args.workers,
                  pin_memory=device.type == "cuda",
                  persistent_workers=False,  # new workers each epoch see the dataset's new epoch
                  generator=torch.Generator().manual_seed(args.seed),  # leaves the global RNG alone
                  collate_fn=collate, worker_init_fn=worker_init)
    if streaming:
        shard = RankStream(train_set, rank, world_size, args.batch_size)
        loader, per_rank = DataLoader(shard, **common), shard.per_rank
    else:
        shard = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        loader, per_rank = DataLoader(train_set, sampler=shard, **common), shard.num_samples
    per_step = args.batch_size * args.accum  # samples per process and optimizer step
    steps_per_epoch = per_rank // per_step
    if steps_per_epoch == 0:
        raise SystemExit(f"an epoch has fewer than {args.accum} batches of {args.batch_size} per process")
    global_batch = world_size * per_step

    # Resume from the newest checkpoint that loads (or from --resume while OUT has none). Rank 0
    # chooses and tells the others, so that all ranks resume from the same one. A DCP checkpoint whose
    # shards then do not load (checksums, or dcp.load failing on any rank) is set aside by every
    # rank at once, and they go on together from the one before it.
    if is_main:
        for stale in out.glob(".*.tmp"):  # a save cut off before its rename (the one it replaced is whole)
            remove(stale)
        (out / STOPPED_MARKER).unlink(missing_ok=True)
    skipped: set[Path] = set()
    model = net = None
    while True:
        ckpt, state = choose_checkpoint(out, args, device, is_main, skipped)
        saved = state.get("settings", {}) if state is not None else {}

        # Where the run is: optimizer steps done, the epoch, and how many of this epoch's samples the
        # ranks took together (which goes on at any number of processes: ResumableSampler, RankStream).
        step, epoch, consumed, best = 0, 0, 0, None
        if state is not None:
            step, best = state["step"], state.get("best")
            if "epoch" in state:
                epoch, consumed = state["epoch"], state["consumed"]
            else:  # (a checkpoint of an earlier version of this script)
                epoch, done = divmod(step, steps_per_epoch)
                consumed = done * saved.get("global_batch", global_batch)
        total_steps = step
        if epoch < args.epochs:  # the rest of this epoch, then whole epochs
            total_steps += (per_rank - consumed // world_size) // per_step + steps_per_epoch * (args.epochs - epoch - 1)
        if args.max_steps is not None:
            total_steps = min(total_steps, args.max_steps)
        resized = state is not None and saved.get("world_size", world_size) != world_size
        if state is not None:
            problems = resume_problems(saved, args, world_size, None if resized else total_steps)
            if problems:
                raise SystemExit(f"{ckpt} was written with other settings: {'; '.join(problems)}. Resume with "
                                 f"the old ones, or start afresh with a new --out")
            with torch.device("meta"):  # another model's checkpoint: said in one line, before anything changes
                problem = model_mismatch(shapes_of(build_model().state_dict()), saved_shapes(ckpt, state))
            if problem:
                raise SystemExit(f"{ckpt} holds another model's weights: {problem}. Resume with the model it "
                                 f"was written with, or start afresh with a new --out (nothing was changed)")
        if model is None:
            startup_mib = peak_memory_mib(device)  # (before the model: what the rest adds is the training's)
            model, net = build_network(args, device, amp_dtype)
        optimizer, scheduler = build_optimizer(model, args, total_steps)
        if state is None or not args.fsdp:
            break
        problem = load_sharded(net, optimizer, ckpt)  # every rank its shards (resharded at another world size)
        if problem is None:
            break
        if args.resume and ckpt == Path(args.resume):
            raise SystemExit(f"--resume {ckpt} could not be loaded ({problem})")
        if is_main:
            log.warning("%s cannot be read (%s): every rank goes on from the checkpoint before it", ckpt, problem)
        skipped.add(ckpt)
        _UNREADABLE.add(ckpt)  # (and the retention does not count it among those kept)
    if args.pretrained:
        log.info("initial weights from %s", args.pretrained)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bf16 needs none

    best_path = out / "best.pt"
    settings = {**{k: getattr(args, k) for k in KEPT_ON_RESUME}, "schedule_steps": total_steps,
                "global_batch": global_batch, "world_size": world_size, "batch_size": args.batch_size,
                "accum": args.accum}
    if state is not None:
        if not args.fsdp:  # (--fsdp: loaded above)
            net.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        if step >= total_steps:
            log.info("%s is at step %d, and this run has %d steps in all: nothing to do (more --epochs or "
                     "--max-steps go on, with --new-schedule)", ckpt, step, total_steps)
        # The scheduler's own state (a plateau's counters, say) comes back where the schedule is the
        # checkpoint's. A schedule of another length (--new-schedule, another number of processes)
        # is built for total_steps instead and stepped to where the run is (learning rate only).
        saved_lr = optimizer.param_groups[0]["lr"]
        same_schedule = not resized and saved.get("schedule_steps", total_steps) == total_steps
        if "scheduler" in state and (same_schedule or isinstance(scheduler, PLATEAU)):
            scheduler.load_state_dict(state["scheduler"])
        elif not isinstance(scheduler, PLATEAU):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
                for _ in range(min(step, total_steps)):
                    scheduler.step()
        new_lr = optimizer.param_groups[0]["lr"]
        if resized:
            log.info("resumed at %d processes, the checkpoint had %d: the global batch is %d (was %d), "
                        "%d steps in all (the schedule rebuilt: learning rate %.4g -> %.4g); the data goes "
                        "on from sample %d of epoch %d in the same order, grouped in other batches; each "
                        "process's random stream starts anew; not bit for bit with an uninterrupted run",
                        world_size, saved["world_size"], global_batch, saved["global_batch"], total_steps,
                        saved_lr, new_lr, consumed // world_size * world_size, epoch)
            mix = (args.seed * 1_000_003 + step) * 1_009 + rank
            random.seed(mix)
            torch.manual_seed(mix)
        else:
            if saved.get("schedule_steps", total_steps) != total_steps:
                log.warning("--new-schedule: %d steps instead of %d; the learning rate goes from %.4g to %.4g",
                            total_steps, saved["schedule_steps"], saved_lr, new_lr)
            set_rng_state(state["rng"][rank], device)
        log.info("resumed from %s at step %d (epoch %d)", ckpt, step, epoch)
        del state  # (the model and optimizer hold their own copies now)

    def save_checkpoint() -> Path:
        """A checkpoint with everything a resume needs; only the newest --keep stay."""
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state(device))  # every rank's generators (e.g. for dropout)
        train_state = {"step": step, "epoch": epoch, "consumed": consumed, "best": best, "rng": rngs,
                       "settings": settings, "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict()}
        if args.fsdp:
            path = out / f"checkpoint-{step:07d}"
            broadcast_buffers(net)  # one rank's buffers are saved: make them every rank's
            save_sharded(net, optimizer, train_state, path, is_main)
        else:
            path = out / f"checkpoint-{step:07d}.pt"
            if is_main:
                save_atomic({"model": net.state_dict(), "optimizer": optimizer.state_dict(), **train_state}, path)
        if is_main:
            prune_checkpoints(out, args.keep)
        return path

    if not args.fsdp:
        # Two validation samples, batched without a DataLoader: iterating one draws from the global
        # random generator, which a resumed run has just restored.
        settle_bucket_order(model, collate([val_set[0], val_set[1 % len(val_set)]]))
    log.info("%d process(es), backend %s, device %s, %s, autocast %s, %d steps of %d x %d x %d samples",
             world_size, dist.get_backend(), device.type, "FSDP" if args.fsdp else "DDP",
             amp_dtype if use_autocast else None, total_steps, world_size, args.accum, args.batch_size)
    bar = tqdm(total=total_steps, initial=step, unit="step", disable=True if not is_main else None)
    stopped = False
    # A stop signal may reach one rank only, and all must stop at the same step: every step all-reduces
    # the ranks' stop flags (the largest wins), without waiting, and reads it one step later (no
    # pause for the GPU).
    stop_votes, stop_work = None, None
    micro_batches = None  # the DataLoader's iterator over this epoch (with its workers)
    first_step = None  # (when, step) this process began training: the rest of its time was start-up

    def epochs_done() -> float:
        return epoch + consumed / (steps_per_epoch * global_batch)

    validated = {}  # the last validation's step and result: the final one reuses it (no second pass)

    def validate_and_keep_best(stop_work):
        """Evaluate, log, and keep best.pt; returns None for the stop vote it waited for."""
        nonlocal best
        if stop_work is not None:
            stop_work.wait()  # (a vote still in flight would meet evaluate's all-reduce; the next step votes again)
        val = evaluate(net, val_set, rank, world_size, device, args, amp_dtype, lockstep=args.fsdp)
        validated.update(step=step, result=val)
        log.info("step %d (epoch %.2f): validation %s", step, epochs_done(),
                 ", ".join(f"{k} {v:.4f}" for k, v in val.items() if k != "count"))
        if is_main:
            write_metrics(metrics, {"step": step, "validation": val}, board)
        value = val[BEST_METRIC]
        if isinstance(scheduler, PLATEAU):
            scheduler.step(value)
        if best is None or (value > best if HIGHER_IS_BETTER else value < best):
            best = value
            save_weights(model_weights(net, args.fsdp), best_path, args.fsdp, is_main,  # (--fsdp: every rank its shards)
                         extra={"step": step, BEST_METRIC: best})
        return None

    metrics = out / "metrics.jsonl"  # rank 0 appends a line per log step and per validation
    if is_main:
        drop_rows_after(metrics, step)  # rows of steps this run does again (after the checkpoint it resumed)
    board = tensorboard_writer(out, purge_step=step) if is_main else None  # and TensorBoard's files, if installed
    window = {"loss": torch.zeros((), device=device), "steps": 0, "since": time.monotonic()}
    while step < total_steps and not stopped:
        if not streaming:
            shard.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        set_epoch(train_set, epoch)  # the augmentation's epoch (workers get a fresh copy each epoch)
        loader.generator.manual_seed(args.seed * 100_003 + epoch)  # workers' seeds: the same on a resume
        shard.skip = consumed // world_size  # mid-epoch resume: the samples this rank took already
        consumed = shard.skip * world_size
        in_epoch = len(shard) // per_step
        steps_now = min(in_epoch, total_steps - step)
        model.train()
        micro_batches = None  # the last epoch's workers stop before the new ones start
        micro_batches = start_workers(loader)
        for i in range(steps_now):
            if FAULTS:  # (testing only)
                fail_once_if_asked(out, rank, step)
                time.sleep(float(FAULTS.get("step_delay", 0)))
            if first_step is None:
                first_step = (time.monotonic(), step)
            if args.fsdp:
                broadcast_buffers(net)  # as DDP's forward does: every rank's BatchNorm statistics are rank 0's
            for k in range(args.accum):
                inputs, targets = to_device(split_batch(next(micro_batches)), device)
                last = k == args.accum - 1
                if args.fsdp:
                    net.set_requires_gradient_sync(last)  # reduce-scatter once per step
                    sync = nullcontext()
                else:
                    sync = model.no_sync() if not last else nullcontext()  # all-reduce once per step
                with sync:
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=use_autocast):
                        loss = loss_fn(model(inputs), targets) / args.accum
                    scaler.scale(loss).backward()
                window["loss"] += loss.detach()
            scaler.unscale_(optimizer)  # clip (and log) the true gradients, not the scaled ones
            # --clip-grad 0: max_norm=inf measures the norm and scales by exactly 1, clipping nothing
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or float("inf"))
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
                grad_norm = grad_norm.full_tensor()
            lr = optimizer.param_groups[0]["lr"]  # this step's (the scheduler sets the next step's below)
            scaler.step(optimizer)  # skipped if fp16 gradients overflowed
            scaler.update()
            if not isinstance(scheduler, PLATEAU):  # (a plateau steps after each validation)
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            consumed += global_batch
            bar.update()
            window["steps"] += 1
            if step % args.log_every == 0:  # (no .item() between these points: the CPU runs ahead of the GPU)
                loss_total = window["loss"].float()
                dist.all_reduce(loss_total)
                seconds = time.monotonic() - window["since"]
                record = {"step": step, "epoch": round(epochs_done(), 4),
                          "loss": loss_total.item() / world_size / window["steps"],  # mean over steps and ranks
                          "grad_norm": grad_norm.item(), "lr": lr,
                          "step_time_s": seconds / window["steps"],
                          "samples_per_s": window["steps"] * global_batch / seconds,
                          "peak_memory_mib": peak_memory_mib(device)}  # (rank 0's, so far)
                eta = round((total_steps - step) * record["step_time_s"])
                log.info("step %d/%d  loss %.4f  grad norm %.3g  lr %.3g  %.0f samples/s  %.3g s/step  "
                         "ETA %d:%02d:%02d", step, total_steps, record["loss"], record["grad_norm"], record["lr"],
                         record["samples_per_s"], record["step_time_s"], eta // 3600, eta // 60 % 60, eta % 60)
                if is_main:
                    write_metrics(metrics, record, board)
                window = {"loss": torch.zeros((), device=device), "steps": 0, "since": time.monotonic()}
            # The stop vote, after this step's row (a stop loses no row of metrics.jsonl or TensorBoard).
            if stop_work is not None:
                stop_work.wait()
                vote = int(stop_votes.item())
                if vote > 0:  # some rank got a stop signal before the step before this one
                    saved_to = save_checkpoint()
                    if is_main:  # for the sbatch: requeue (SIGUSR1) or not, and how much this attempt did
                        started, first = first_step
                        (out / STOPPED_MARKER).write_text(
                            f"{'requeue' if vote == 2 else 'stop'} {round(started - STARTED)} "
                            f"{round(time.monotonic() - started)} {step - first}\n")
                    # No rank exits before rank 0 has written: an exit ends that rank's torchrun,
                    # and under `srun --kill-on-bad-exit` the whole step with it.
                    dist.barrier()
                    log.info("%s: saved %s at step %d; run the same command to resume",
                             f"{STOP_SIGNAL} ({STOP_MEANING.get(STOP_SIGNAL, '')})" if STOP_SIGNAL
                             else "a stop signal to another process", saved_to, step)
                    stopped = True
                    break
            stop_votes = torch.tensor([float(STOP_REQUESTED)], device=device)
            stop_work = dist.all_reduce(stop_votes, op=dist.ReduceOp.MAX, async_op=True)
            last_of_pass = i == steps_now - 1  # (the epoch's or the run's end: validated and saved below)
            if args.eval_every and step % args.eval_every == 0 and not last_of_pass:
                stop_work = validate_and_keep_best(stop_work)
            if step % args.checkpoint_every == 0 and not last_of_pass:
                save_checkpoint()
        if stopped:
            break
        if steps_now == in_epoch:  # the epoch is over
            epoch, consumed = epoch + 1, 0
        stop_work = validate_and_keep_best(stop_work)  # validate, keep the best, checkpoint
        save_checkpoint()
    micro_batches = None  # stops this epoch's workers now (os._exit below would leave them behind)
    bar.close()
    if board is not None:
        board.close()

    if not stopped:
        val = validated["result"] if validated.get("step") == step else \
            evaluate(net, val_set, rank, world_size, device, args, amp_dtype, lockstep=args.fsdp)
        weights = model_weights(net, args.fsdp)
        digest = weights_sha256(weights)  # (--fsdp: every rank takes part, one tensor at a time)
        final = save_weights(weights, out / "final.pt", args.fsdp, is_main)
        memory = [None] * world_size  # each rank's peak, and how much of it came after the start-up
        dist.all_gather_object(memory, (peak_memory_mib(device), startup_mib))
        memory = {"peak": [m[0] for m in memory], "startup": [m[1] for m in memory]}
        if is_main and None not in memory["peak"]:
            log.info("peak memory per rank: %s MiB (%s after the start-up; %s)",
                     ", ".join(f"{m:.0f}" for m in memory["peak"]),
                     ", ".join(f"+{m - b:.0f}" for m, b in zip(memory["peak"], memory["startup"])),
                     "GPU tensors" if device.type == "cuda" else "resident set")
        if is_main:
            log.info("final: validation %s, weights sha256 %s, in %s%s",
                     ", ".join(f"{k} {v:.4f}" for k, v in val.items() if k != "count"), digest[:16], final,
                     f" (one file: python -m torch.distributed.checkpoint.format_utils dcp_to_torch {final} "
                     f"{final}.pt)" if args.fsdp else "")
            result = {**val, "step": step, "world_size": world_size, "weights_sha256": digest,
                      "memory_mib": memory}
            (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    exit_now(0)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:  # a refusal (bad input, other settings): one line, no traceback
        if stop.code not in (None, 0):
            print(stop.code if isinstance(stop.code, str) else f"exit status {stop.code}", file=sys.stderr)
        exit_now(stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, then out at once (see main)
        traceback.print_exc()
        exit_now(1)
