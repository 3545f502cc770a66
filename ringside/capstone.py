"""The given parts of the capstone (lab 11): what its script needs but does not teach.

labs/11_capstone.py imports these, so that the file a learner opens holds the parts that are the
lesson: the loader, augmentation, the model in DDP, the step, checkpoints, evaluation and the loop.
Here: the command line, joining the group, the data, the network and its rank-ordered gradient hook
(why: chapter 11, section 3), the autocast type, fault injection, the curves, and the run's records.
template/train_ddp.py is the same script grown for real jobs; it imports nothing from here.
(No `from __future__ import annotations` here: DDP's register_comm_hook reads rank_ordered_mean's
annotation and refuses a string where it wants dist.GradBucket.)
"""

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from .data import digits_split
from .runtime import DEFAULT_TIMEOUT, Rank, attempt_store, device_for, identity_from_env, pick_backend

ACCURACY_BAND = (0.93, 1.0)  # measured with the defaults below: 0.964, 0.972, 0.978 at 1, 2, 4 ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Data-parallel training of a small CNN, with checkpoints.")
    arg, flag = p.add_argument, argparse.BooleanOptionalAction
    arg("--out", default="runs/capstone", help="checkpoint, final weights, curves (default: %(default)s)")
    arg("--data", choices=["digits", "mnist", "cifar10"], default="digits",
        help="digits ship with scikit-learn; mnist/cifar10 need --data-dir (never downloaded)")
    arg("--data-dir", default=None, help="where torchvision's MNIST or CIFAR-10 already is")
    arg("--epochs", type=int, default=3)
    arg("--batch-size", type=int, default=64, help="global batch, split evenly over the ranks")
    arg("--lr", type=float, default=0.2)
    arg("--seed", type=int, default=0)
    arg("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    arg("--amp", action=flag, default=None, help="autocast (see amp_dtype; default: on a GPU only: a CPU without "
        "bfloat16 units runs these convolutions about 7x slower)")
    arg("--fresh", action="store_true", help="start afresh even if OUT/checkpoint.pt exists (by default a run, "
        "restarted by torchrun or relaunched by hand, resumes from it)")
    arg("--kill-rank", type=int, default=1, help="fault injection: the rank that dies")
    arg("--kill-at-step", type=int, default=None,
        help="fault injection: that rank kills itself (SIGKILL) before this step, unless the run resumed")
    arg("--resume-check", action=flag, default=True, help="the self-check also resumes from a mid-epoch checkpoint and compares")
    arg("--progress", action=flag, default=None, help="rank 0's progress bar (default: if stderr is a terminal)")
    args = p.parse_args(argv)
    if args.data != "digits" and not args.data_dir:
        p.error(f"--data {args.data} needs --data-dir")
    return args


def join_group() -> Rank:
    """Join torchrun's process group, in a key space of this attempt's own.

    torchrun may keep one key-value store for the whole job, restarts included, and the ranks of a
    killed attempt leave their addresses in it: ringside.runtime.attempt_store gives every attempt a
    store of its own (rank 0 starts it and posts its port), which all ranks find whichever node they
    are on and however many ranks died before they joined."""
    rank, world_size, local_rank = identity_from_env()
    backend, device_type = pick_backend()
    device = device_for(device_type, local_rank)
    store = attempt_store(rank, world_size, DEFAULT_TIMEOUT)
    kwargs = {"device_id": device} if device_type == "cuda" else {}
    # DEFAULT_TIMEOUT is the course's 30 s, so that a broken lab fails fast; do not copy it into a real
    # job, where a collective can wait minutes for a slow rank (a checkpoint write, a data stall):
    # template/train_ddp.py takes --timeout-s (600 s by default)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=DEFAULT_TIMEOUT, **kwargs)
    return Rank(rank, world_size, local_rank, dist.get_backend(), device)


def load_data(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) as tensors of images N x C x H x W in [0, 1] and labels."""
    if args.data == "digits":
        return digits_split(flat=False)  # 1,438 + 359 images of 1 x 8 x 8, no download
    from torchvision import datasets

    sets = []
    for train in (True, False):
        kind = {"mnist": datasets.MNIST, "cifar10": datasets.CIFAR10}[args.data]
        raw = kind(args.data_dir, train=train, download=False)
        x = torch.as_tensor(raw.data).float() / 255  # MNIST: N x 28 x 28, CIFAR-10: N x 32 x 32 x 3
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
        sets.append(TensorDataset(x.contiguous(), torch.as_tensor(raw.targets)))
    return sets[0], sets[1]


def make_net(channels: int, classes: int = 10) -> nn.Module:
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(*block(channels, 16), *block(16, 32), nn.MaxPool2d(2), *block(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def rank_ordered_mean(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of the ranks' gradients, added up in rank order.

    DDP's own all_reduce adds the ranks' numbers in an order that depends on where a gradient
    sits in its bucket, and DDP re-arranges its buckets after the first step - so the first step
    after a resume rounds differently in the last bit (with 3 ranks or more). Gathering the
    buckets and adding them in rank order rounds the same way every time: bit-exact resumes."""
    grads = bucket.buffer()
    copies = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, grads)
    total = copies[0].clone()
    for other in copies[1:]:
        total += other
    future = torch.futures.Future()
    future.set_result(total / len(copies))
    return future


def amp_dtype(args: argparse.Namespace, me: Rank) -> torch.dtype | None:
    """The autocast type, or None: bfloat16 where the GPU runs it natively (Ampere and later: float32's
    range, no scaler needed), else float16 (needs the GradScaler); bfloat16 on the CPU (only with --amp)."""
    if not (args.amp if args.amp is not None else me.device.type == "cuda"):
        return None
    if me.device.type == "cuda":
        # including_emulation=False: the default (True) also answers True on a V100 or T4, which only
        # emulate bfloat16 (torch/cuda/__init__.py, is_bf16_supported); those GPUs want float16
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native_bf16 else torch.float16
    return torch.bfloat16


@dataclass
class Progress:
    """Where the run is; saved in every checkpoint and restored on resume."""

    epoch: int = 0  # the epoch in progress
    step_in_epoch: int = 0  # batches of that epoch already done
    global_step: int = 0
    loss_sum: float = 0.0  # sum of this epoch's (rank-averaged) batch losses so far
    history: list = field(default_factory=list)  # one dict per finished epoch


def maybe_die(args: argparse.Namespace, me: Rank, step: int) -> None:
    """Fault injection for the demo and the test: one rank dies hard (train calls it only in a run
    that did not resume, so the restarted job gets past the step)."""
    if args.kill_at_step == step and me.rank == args.kill_rank:
        print(f"rank {me.rank}: killing myself (SIGKILL) before step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_found(ckpt: Path, me: Rank, fresh: bool) -> bool:
    """Whether the run resumes from `ckpt` (deleted first with fresh=True). Rank 0 looks and tells
    every rank: all ranks must take the same branch, and a rank that looked on its own could see the
    file a moment earlier or later (on another node, on a shared file system)."""
    if me.is_main:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            ckpt.unlink(missing_ok=True)
    found = torch.tensor([float(me.is_main and ckpt.exists())], device=me.device)
    dist.broadcast(found, src=0)
    return bool(found.item())


def require_same_world_size(state: dict, me: Rank, ckpt: Path) -> None:
    """A checkpoint holds one shard position per rank count: resuming with another count is refused."""
    if state["world_size"] != me.world_size:
        raise RuntimeError(f"{ckpt} was written by {state['world_size']} ranks, this job has "
                           f"{me.world_size}: resume with the same number, or start afresh (--fresh)")


def progress_bar(args: argparse.Namespace, me: Rank, total: int, done: int) -> tqdm:
    """Rank 0's bar (the others' is disabled): shown if --progress, or by default if stderr is a terminal."""
    show = me.is_main and (args.progress if args.progress is not None else sys.stderr.isatty())
    return tqdm(total=total, initial=done, disable=not show, unit="step")


def save_history(history: list[dict], out: Path) -> None:
    """The per-epoch records as out/history.json, and their curves as out/curves.png."""
    (out / "history.json").write_text(json.dumps(history, indent=1))
    save_curves(history, out / "curves.png")


def save_curves(history: list[dict], path: Path) -> None:
    """Loss and accuracy per epoch, as a PNG (no pyplot: the caller's backend is left alone)."""
    from matplotlib.figure import Figure

    epochs, fig = [h["epoch"] + 1 for h in history], Figure(figsize=(8, 3))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for key in ("train_loss", "test_loss"):
        ax_loss.plot(epochs, [h[key] for h in history], "o-", label=key[:-5])
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss", xticks=epochs)
    ax_loss.legend()
    ax_acc.plot(epochs, [h["test_accuracy"] for h in history], "o-", color="C2")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="test accuracy", xticks=epochs)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


@dataclass
class Result:
    """What train returns, for the check and the notebook: the model, its loader, where the run ended."""

    model: DDP
    loader: DataLoader
    progress: Progress
    resumed_from: int | None  # the global step of the checkpoint it resumed from
    steps_run: int  # steps this call trained (after the resume)
    test: dict
