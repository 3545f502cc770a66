"""Data-parallel training with DDP and torchrun: a template to copy and adapt to your own model.

Plain PyTorch, the standard library and tqdm: nothing from the course. The parts you replace for your
own work are `build_datasets`, `build_model`, `loss_fn`, `metric_sums` with `BEST_METRIC`, and
(maybe) `collate`, `split_batch` and `build_optimizer`; see template/README.md. Everything else (the
process group, sharding, mixed precision, accumulation, exact evaluation, checkpoints, resume,
SIGTERM) works as is on CPUs (gloo) and GPUs (nccl).

One machine (1 process, or one per GPU / 4 CPU processes):
    torchrun --standalone --nproc-per-node 1 template/train_ddp.py --out runs/demo
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 template/train_ddp.py --out runs/demo
Two machines, static rendezvous (run on each; --node-rank 0 on the machine at MASTER_IP):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr MASTER_IP --master-port 29500 \\
        template/train_ddp.py --out /shared/runs/demo
Two machines, c10d rendezvous (the same command on both; survives a crashed rank with --max-restarts):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint MASTER_IP:29500 \\
        --rdzv-id demo --max-restarts 3 template/train_ddp.py --out /shared/runs/demo
Slurm: template/train_ddp.sbatch. On several machines --out must be a folder that every machine sees.

Run the same command again and it resumes from the newest OUT/checkpoint-<step>.pt (a new --out starts
afresh; changed settings are refused, another --epochs or --max-steps too unless --new-schedule).
`kill -TERM` (Slurm's preemption signal) saves a checkpoint within two steps and exits, whenever it
comes.
"""

from __future__ import annotations

import signal

# SIGTERM (Slurm's warning, torchrun passing a signal on) only sets this flag; training acts on it at
# the next step. Installed before anything else: a signal during the seconds of `import torch` must
# not kill the process either.
STOP_REQUESTED = False


def request_stop(signum, frame) -> None:
    global STOP_REQUESTED
    STOP_REQUESTED = True  # acted on at the next step boundary, where the state is consistent


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, request_stop)

import argparse  # noqa: E402 - after the handler above
import ctypes  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, default_collate  # noqa: E402
from tqdm import tqdm  # noqa: E402

log = logging.getLogger("train_ddp")


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


# --- Data: replace build_datasets with your own (any map-style Dataset works) -----------------------


class Digits(Dataset):
    """scikit-learn's 8x8 handwritten digits (no download), with a light random shift and noise.

    The augmentation is drawn from (seed, epoch, index) only: the same for any number of processes
    or loader workers, and a resumed run redoes a sample exactly as the first run did."""

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
    """(train, validation): the same split on every process (it comes from a fixed seed)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    val, train = order[:360], order[360:]
    return (Digits(images[train], labels[train], augment=True, seed=seed),
            Digits(images[val], labels[val], augment=False, seed=seed))


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can skip the first `skip` samples of this rank's epoch.

    Resuming mid-epoch this way never loads the skipped samples."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


# --- Model, loss, optimizer: replace with your own ----------------------------------------------------


def build_model() -> nn.Module:
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(*block(1, 16), *block(16, 32), nn.MaxPool2d(2), *block(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The training loss; evaluate() calls it with reduction="sum". A language model's (B, T, V)
    logits: F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction=reduction)."""
    return F.cross_entropy(outputs, targets, reduction=reduction)


def metric_sums(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over one validation batch that add up over batches and ranks; evaluate() divides each by
    the total "count" (samples, tokens or pixels: whatever one target is). Here: accuracy for any
    outputs whose dimension 1 holds the classes, one label per sample or per pixel."""
    return {"loss": loss_fn(outputs.float(), targets, reduction="sum"),
            "accuracy": (outputs.argmax(1) == targets).sum(), "count": torch.tensor(targets.numel())}


def collate(samples: list):
    """One batch from a list of samples (the DataLoader's collate_fn, in training and evaluation).
    default_collate stacks tensors of one shape; sequences of different lengths need padding to the
    longest in each batch, e.g. with their lengths for the model:
        tokens = [x for x, _ in samples]
        padded = nn.utils.rnn.pad_sequence(tokens, batch_first=True)  # pads with 0
        return (padded, torch.tensor([len(x) for x in tokens])), torch.stack([y for _, y in samples])"""
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
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(1, total_steps))
    return optimizer, scheduler


# --- Checkpoints -------------------------------------------------------------------------------------------


def save_atomic(obj, path: Path) -> None:
    """Write to a temporary file, then rename: a crash mid-save leaves the previous file intact."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _READABLE.add(path)


def checkpoints(out: Path) -> list[Path]:
    """OUT/checkpoint-<step>.pt, newest first."""
    return sorted(out.glob("checkpoint-*.pt"), key=lambda p: int(p.stem.split("-")[1]), reverse=True)


def newest_loadable_checkpoint(out: Path, device: torch.device) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; one that does not (cut off by a full disk, say) is skipped
    with a warning and the one before it is used. None when there is none at all; when there are
    some but none loads, refuse (starting from step 0 would throw the run away silently)."""
    found = checkpoints(out)
    for path in found:
        try:
            return path, torch.load(path, map_location=device, weights_only=True)
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


def readable(path: Path) -> bool:
    """Whether a checkpoint file is whole: torch.save writes a zip archive, and every member's CRC
    must match (reads the file, unpickles nothing). Remembered: each file is checked once."""
    if path in _READABLE:
        return True
    try:
        with zipfile.ZipFile(path) as archive:
            whole = archive.testzip() is None
    except (OSError, zipfile.BadZipFile):
        whole = False
    if whole:
        _READABLE.add(path)
    return whole


def prune_checkpoints(out: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints that can be read; delete the others, unreadable ones too
    (counting a cut-off file as kept would delete the good ones it replaced)."""
    kept = 0
    for path in checkpoints(out):
        if kept < keep and readable(path):
            kept += 1
        else:
            path.unlink(missing_ok=True)
            _READABLE.discard(path)


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


def load_pretrained(model: nn.Module, path: str) -> None:
    """Weights from a file: a state_dict, or a checkpoint with a "model" entry.

    Keys saved from a DDP-wrapped model start with "module.": that prefix (and only a prefix) is
    removed. weights_only=True: the file can hold tensors and plain containers, never code."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    model.load_state_dict(state)  # strict: a key that does not fit is an error, not a silent skip


def to_device(x, device: torch.device):
    """Tensors, and dicts, lists and tuples of them, moved to `device` (asynchronously from pinned memory)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def write_metrics(path: Path, record: dict, board=None) -> None:
    """One JSON line per record (read back with pandas.read_json(path, lines=True)); to TensorBoard
    too when `board` is a SummaryWriter."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if board is not None:
        group = "validation" if "validation" in record else "train"
        for name, value in record.get("validation", record).items():
            if name not in ("step", "epoch", "count"):
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


def weights_sha256(model: nn.Module) -> str:
    """A fingerprint of every parameter and buffer: equal fingerprints, bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- Evaluation: every validation sample counted exactly once --------------------------------------


@torch.no_grad()
def evaluate(net: nn.Module, val_set: Dataset, rank: int, world_size: int, device: torch.device,
             args: argparse.Namespace, amp_dtype) -> dict:
    """Exact metrics over the validation set (metric_sums, added over every batch and rank, each
    divided by the total count); each rank takes indices rank, rank + W, ...

    (DistributedSampler would pad the last round with duplicates.) Takes the bare network, not the
    DDP wrapper: ranks may run different numbers of batches, and DDP's forward talks to the others."""
    was_training = net.training
    net.eval()
    # Rank 0's buffers (BatchNorm's running statistics) on every rank, as DDP's forward uses them
    # (broadcast_buffers) and as final.pt holds them: each rank's own would make the result depend on
    # the number of processes. (Training is unchanged: DDP broadcasts them again at its next forward.)
    for buffer in net.buffers():
        dist.broadcast(buffer, 0)
    mine = Subset(val_set, range(rank, len(val_set), world_size))
    loader = DataLoader(mine, batch_size=args.batch_size, num_workers=0, pin_memory=device.type == "cuda",
                        collate_fn=collate,
                        generator=torch.Generator())  # its own: iterating must not move the global generator
    totals: dict[str, torch.Tensor] = {}
    for batch in loader:
        inputs, targets = to_device(split_batch(batch), device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            outputs = net(inputs)
        for name, value in metric_sums(outputs, targets).items():
            totals[name] = totals.get(name, 0) + value.detach().double().to(device)
    names = sorted(totals)  # the same order on every rank (main() checks that each rank has a sample)
    sums = torch.stack([totals[n] for n in names])
    dist.all_reduce(sums)
    net.train(was_training)
    total = dict(zip(names, sums.tolist()))
    count = total.pop("count")
    return {**{n: v / count for n, v in total.items()}, "count": int(count)}


# --- Training ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="DDP training with torchrun (see the docstring for commands)")
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
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="auto: bf16 on GPUs that run it natively (Ampere+), else fp16 + GradScaler; off on the CPU")
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
    # Testing only (not listed by --help): --fail-rank kills itself (SIGKILL) before step
    # --fail-at-step, once per --out (-1: before it joins the process group; may be given several
    # times); --step-delay sleeps this long in every step (a slow model).
    p.add_argument("--fail-at-step", type=int, action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--fail-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--step-delay", type=float, default=0, help=argparse.SUPPRESS)
    return p


TEST_ONLY_OPTIONS = ("--fail-at-step", "--fail-rank", "--step-delay")


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# Settings a resume must keep: they change the arithmetic of the steps still to come. (Other --epochs
# or --max-steps change the schedule's length: refused unless --new-schedule. Another number of
# processes is fine at the same global batch, processes x --batch-size x --accum, but not bit for bit.)
KEPT_ON_RESUME = ("seed", "lr", "clip_grad", "amp", "sync_bn")


def resume_problems(saved: dict, args: argparse.Namespace, world_size: int,
                    total_steps: int | None = None) -> list[str]:
    """Why a checkpoint written with settings `saved` cannot go on with these; [] if it can."""
    problems = [f"--{k.replace('_', '-')} was {saved[k]}, now {getattr(args, k)}"
                for k in KEPT_ON_RESUME if k in saved and saved[k] != getattr(args, k)]
    global_batch = world_size * args.batch_size * args.accum
    if "global_batch" in saved and saved["global_batch"] != global_batch:
        problems.append(f"the global batch (processes x --batch-size x --accum) was {saved['global_batch']}, "
                        f"now {global_batch}")
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


def pick_amp(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full float32."""
    if choice == "auto":
        if device.type != "cuda":
            return None  # CPUs without 16-bit units run autocast several times slower
        # including_emulation=False: by default is_bf16_supported() also says True on a V100 or T4,
        # which only emulate bf16 (torch/cuda/__init__.py); native bf16 needs compute capability 8.0+
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native_bf16 else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[choice]


TRAINER_PID = os.getpid()  # (set again in main(); forked DataLoader workers inherit it)


def worker_init(worker_id: int) -> None:
    """First thing in every DataLoader worker. Slurm and torchrun signal every process, and a worker
    killed by SIGTERM makes the training process raise before it can save; so workers ignore SIGTERM.
    They are forked with SIGTERM blocked (start_workers): one that arrived since is still pending,
    and SIG_IGN discards it before the unblock. And a worker dies with its training process
    (Linux: PR_SET_PDEATHSIG), even one killed with SIGKILL, instead of lingering for seconds."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # (POSIX; Windows has no signal masks)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != TRAINER_PID:  # it died before prctl: no signal would come
            os._exit(0)


def start_workers(loader: DataLoader):
    """iter(loader), with SIGTERM blocked while it forks the workers (they inherit the blocked
    signal until worker_init ignores it). PyTorch's own SIGTERM handler, installed in a worker
    before worker_init runs, would otherwise let a signal in that window kill it. This process
    receives a SIGTERM that arrived meanwhile as soon as the signal is unblocked."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (and no fork)
        return iter(loader)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def fail_once_if_asked(args: argparse.Namespace, out: Path, rank: int, step: int) -> None:
    """Testing: the crash that --fail-at-step asks for, once per --out (whatever restarts follow)."""
    if step in args.fail_at_step and rank == args.fail_rank:
        marker = out / f".failed_at_step_{step}"
        if not marker.exists():
            marker.touch()
            print(f"rank {rank}: killing myself (SIGKILL) before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


@record  # an exception's traceback goes to torchrun's summary of the failed ranks
def main() -> None:
    args = parse_args()
    out = Path(args.out)
    ensure_writable(out)  # every process, before any waits for another
    fail_once_if_asked(args, out, int(os.environ.get("RANK", 0)), step=-1)  # testing: a start-up crash
    rank, world_size, device = setup_distributed(args.timeout_s)
    is_main = rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, request_stop)  # (set at import already when run as a script)
    global TRAINER_PID
    TRAINER_PID = os.getpid()

    # Reproducible: the same seed gives the same initial weights, data order and augmentation.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":  # deterministic: bit-exact resumes; else cuDNN's fastest algorithms
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = args.deterministic, not args.deterministic

    train_set, val_set = build_datasets(args.seed)
    if len(val_set) < world_size:
        raise SystemExit(f"{len(val_set)} validation samples for {world_size} processes: each needs one at least")
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=False,  # new workers each epoch see the dataset's new epoch
                        generator=torch.Generator().manual_seed(args.seed),  # leaves the global RNG alone
                        collate_fn=collate, worker_init_fn=worker_init)
    steps_per_epoch = len(sampler) // args.batch_size // args.accum
    if steps_per_epoch == 0:
        raise SystemExit(f"an epoch has fewer than {args.accum} batches of {args.batch_size} per process")
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)

    net = build_model()
    if args.pretrained:
        load_pretrained(net, args.pretrained)
        log.info("initial weights from %s", args.pretrained)
    if args.sync_bn:
        if device.type != "cuda":
            log.warning("--sync-bn needs nccl: on the CPU each rank keeps its own BatchNorm statistics")
        else:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net.to(device)
    if args.tf32:
        torch.set_float32_matmul_precision("high")  # (cuDNN's convolutions use TF32 by default already)
    if args.compile:
        net.compile()  # nn.Module.compile: in place, so state_dict keys stay as they are
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer, scheduler = build_optimizer(model, args, total_steps)
    amp_dtype = pick_amp(args.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bf16 needs none

    best_path = out / "best.pt"
    settings = {**{k: getattr(args, k) for k in KEPT_ON_RESUME}, "schedule_steps": total_steps,
                "global_batch": world_size * args.batch_size * args.accum, "world_size": world_size}
    step, best = 0, None  # step: optimizer steps done; best: the best value of BEST_METRIC so far
    # Resume from the newest checkpoint that loads. Rank 0 chooses and tells the others, so that all
    # ranks resume from the same file.
    found, refused = None, None
    if is_main:
        for stale in out.glob(".*.tmp"):  # a save cut off before its rename (the file it replaced is whole)
            stale.unlink(missing_ok=True)
        try:
            found = newest_loadable_checkpoint(out, device)
        except CheckpointError as error:
            refused = str(error)
    chosen = [str(found[0]) if found else None, refused]
    dist.broadcast_object_list(chosen)
    if chosen[1]:
        raise SystemExit(chosen[1])  # on every rank: none waits for the others
    if chosen[0] is not None:
        ckpt = Path(chosen[0])
        # (FileNotFoundError on another machine: --out is not a folder that every machine sees)
        state = found[1] if is_main else torch.load(ckpt, map_location=device, weights_only=True)
        saved = state.get("settings", {})
        problems = resume_problems(saved, args, world_size, total_steps)
        if problems:
            raise SystemExit(f"{ckpt} was written with other settings: {'; '.join(problems)}. Resume with "
                             f"the old ones, or start afresh with a new --out")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step, best = state["step"], state.get("best")
        if step >= total_steps:
            log.info("%s is at step %d, and this run has %d steps in all: nothing to do (more --epochs or "
                     "--max-steps go on, with --new-schedule)", ckpt, step, total_steps)
        # The schedule is built for total_steps (the same as the checkpoint's, or a new one with
        # --new-schedule), not restored: step it to where the run is (learning rate only, no update).
        saved_lr = optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
            for _ in range(min(step, total_steps)):
                scheduler.step()
        if saved.get("schedule_steps", total_steps) != total_steps:
            log.warning("--new-schedule: %d steps instead of %d; the learning rate goes from %.4g to %.4g",
                        total_steps, saved["schedule_steps"], saved_lr, optimizer.param_groups[0]["lr"])
        if len(state["rng"]) == world_size:
            set_rng_state(state["rng"][rank], device)
        else:
            log.warning("resumed with %d processes instead of %d (same global batch): the data order is the "
                        "same, the ranks' random streams are not", world_size, len(state["rng"]))
        log.info("resumed from %s at step %d (epoch %d)", ckpt, step, step // max(1, steps_per_epoch))

    def save_checkpoint() -> Path:
        """OUT/checkpoint-<step>.pt with everything a resume needs; only the newest --keep stay."""
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state(device))  # every rank's generators (e.g. for dropout)
        path = out / f"checkpoint-{step:07d}.pt"
        if is_main:
            save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "step": step, "best": best, "rng": rngs,
                         "settings": settings}, path)
            prune_checkpoints(out, args.keep)
        return path

    # Two validation samples, batched without a DataLoader: iterating one draws from the global
    # random generator, which a resumed run has just restored.
    settle_bucket_order(model, collate([val_set[0], val_set[1 % len(val_set)]]))
    log.info("%d process(es), backend %s, device %s, autocast %s, %d steps of %d x %d x %d samples",
             world_size, dist.get_backend(), device.type, amp_dtype, total_steps, world_size,
             args.accum, args.batch_size)
    bar = tqdm(total=total_steps, initial=step, unit="step", disable=True if not is_main else None)
    stopped = False
    # SIGTERM may reach one rank only, and all must stop at the same step: every step all-reduces the
    # ranks' stop flags, without waiting, and reads the sum one step later (no pause for the GPU).
    stop_votes, stop_work = None, None
    micro_batches = None  # the DataLoader's iterator over this epoch (with its workers)

    def validate_and_keep_best(stop_work):
        """Evaluate, log, and keep best.pt; returns None for the stop vote it waited for."""
        nonlocal best
        if stop_work is not None:
            stop_work.wait()  # (a vote still in flight would meet evaluate's all-reduce; the next step votes again)
        val = evaluate(model.module, val_set, rank, world_size, device, args, amp_dtype)
        log.info("step %d (epoch %.2f): validation %s", step, step / steps_per_epoch,
                 ", ".join(f"{k} {v:.4f}" for k, v in val.items() if k != "count"))
        if is_main:
            write_metrics(metrics, {"step": step, "validation": val}, board)
        value = val[BEST_METRIC]
        if best is None or (value > best if HIGHER_IS_BETTER else value < best):
            best = value
            if is_main:
                save_atomic({"model": model.module.state_dict(), "step": step, BEST_METRIC: best}, best_path)
        return None

    metrics = out / "metrics.jsonl"  # rank 0 appends a line per log step and per validation
    if is_main:
        drop_rows_after(metrics, step)  # rows of steps this run does again (after the checkpoint it resumed)
    board = tensorboard_writer(out, purge_step=step) if is_main else None  # and TensorBoard's files, if installed
    window = {"loss": torch.zeros((), device=device), "steps": 0, "since": time.monotonic()}
    while step < total_steps and not stopped:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        loader.generator.manual_seed(args.seed * 100_003 + epoch)  # workers' seeds: the same on a resume
        train_set.epoch = epoch  # the augmentation's epoch (workers get a fresh copy each epoch)
        sampler.skip = done_in_epoch * args.accum * args.batch_size  # mid-epoch resume
        model.train()
        micro_batches = None  # the last epoch's workers stop before the new ones start
        micro_batches = start_workers(loader)
        for _ in range(done_in_epoch, min(steps_per_epoch, done_in_epoch + total_steps - step)):
            fail_once_if_asked(args, out, rank, step)
            time.sleep(args.step_delay)
            for k in range(args.accum):
                inputs, targets = to_device(split_batch(next(micro_batches)), device)
                last = k == args.accum - 1
                with model.no_sync() if not last else nullcontext():  # all-reduce once per step
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                        loss = loss_fn(model(inputs), targets) / args.accum
                    scaler.scale(loss).backward()
                window["loss"] += loss.detach()
            scaler.unscale_(optimizer)  # clip (and log) the true gradients, not the scaled ones
            # --clip-grad 0: max_norm=inf measures the norm and scales by exactly 1, clipping nothing
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or float("inf"))
            scaler.step(optimizer)  # skipped if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update()
            if stop_work is not None:
                stop_work.wait()
                if stop_votes.item() > 0:  # some rank got SIGTERM before the step before this one
                    saved_to = save_checkpoint()
                    # No rank exits before rank 0 has written: an exit ends that rank's torchrun,
                    # and under `srun --kill-on-bad-exit` the whole step with it.
                    dist.barrier()
                    log.info("SIGTERM: saved %s at step %d; run the same command to resume", saved_to, step)
                    stopped = True
                    break
            stop_votes = torch.tensor([float(STOP_REQUESTED)], device=device)
            stop_work = dist.all_reduce(stop_votes, async_op=True)
            window["steps"] += 1
            if step % args.log_every == 0:  # (no .item() between these points: the CPU runs ahead of the GPU)
                loss_total = window["loss"].float()
                dist.all_reduce(loss_total)
                seconds = time.monotonic() - window["since"]
                record = {"step": step, "epoch": round(step / steps_per_epoch, 4),
                          "loss": loss_total.item() / world_size / window["steps"],  # mean over steps and ranks
                          "grad_norm": grad_norm.item(), "lr": scheduler.get_last_lr()[0],
                          "step_time_s": seconds / window["steps"],
                          "samples_per_s": window["steps"] * settings["global_batch"] / seconds}
                eta = round((total_steps - step) * record["step_time_s"])
                log.info("step %d/%d  loss %.4f  grad norm %.3g  lr %.3g  %.0f samples/s  %.3g s/step  "
                         "ETA %d:%02d:%02d", step, total_steps, record["loss"], record["grad_norm"], record["lr"],
                         record["samples_per_s"], record["step_time_s"], eta // 3600, eta // 60 % 60, eta % 60)
                if is_main:
                    write_metrics(metrics, record, board)
                window = {"loss": torch.zeros((), device=device), "steps": 0, "since": time.monotonic()}
            mid_epoch = step % steps_per_epoch != 0 and step != total_steps  # (the epoch's end does both below)
            if args.eval_every and step % args.eval_every == 0 and mid_epoch:
                stop_work = validate_and_keep_best(stop_work)
            if step % args.checkpoint_every == 0 and mid_epoch:
                save_checkpoint()
        if stopped:
            break
        if step % steps_per_epoch == 0 or step == total_steps:  # validate, keep the best, checkpoint
            stop_work = validate_and_keep_best(stop_work)
            save_checkpoint()
    micro_batches = None  # stops this epoch's workers now (os._exit below would leave them behind)
    bar.close()
    if board is not None:
        board.close()


    if not stopped:
        val = evaluate(model.module, val_set, rank, world_size, device, args, amp_dtype)
        digest = weights_sha256(model.module)
        log.info("final: validation %s, weights sha256 %s",
                 ", ".join(f"{k} {v:.4f}" for k, v in val.items() if k != "count"), digest[:16])
        if is_main:
            save_atomic(model.module.state_dict(), out / "final.pt")
            result = {**val, "step": step, "world_size": world_size, "weights_sha256": digest}
            (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit ("terminate called without an active exception")


if __name__ == "__main__":
    main()
