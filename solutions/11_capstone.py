"""Lab 11 - capstone: one real training script with everything, that survives a killed rank.

A small CNN on real handwritten digits: torchrun, DDP, a sampler with set_epoch, SyncBN, seeding,
autocast, exact evaluation, and atomic checkpoints a restarted job resumes from, bit for bit.
Fill in the TODOs; the check trains, evaluates, resumes from a mid-epoch checkpoint and compares.

Run the lab (the self-check) with 2 processes:
    make lab CH=11 NPROC=2
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 labs/11_capstone.py)
Train for real, let rank 1 die before step 35 and torchrun restart the job, which resumes from the
checkpoint of step 30 (checkpoints every 10 steps: a kill at a checkpoint step would race its write):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        labs/11_capstone.py --out runs/killed --kill-rank 1 --kill-at-step 35 --no-resume-check
More options: --help (e.g. --data mnist --data-dir ~/data for torchvision's MNIST on disk).
"""
# SOLUTION FILE

import argparse
import itertools
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.transforms import v2

from ringside import Rank, print0
from ringside.capstone import (Progress, Result, amp_dtype, checkpoint_found, load_data, make_net, maybe_die,
                               progress_bar, rank_ordered_mean, require_same_world_size, save_history)
from ringside.syncbn import convert_sync_batchnorm

# The given parts (the command line, joining the group, the data, the network, fault injection, the
# log) are in ringside/capstone.py. rank_ordered_mean is this chapter's lesson: chapter 11, section 3.


# --- Data: real digits, one shard per rank, augmentation seeded per rank and step -----------------


def make_train_loader(train_set: TensorDataset, batch_per_rank: int, seed: int, me: Rank) -> DataLoader:
    """This rank's shuffled share of the training set, in batches of batch_per_rank."""
    # HINT 1: the ranks must cut one shared permutation into disjoint shards (the same seed everywhere), and every step must be a full batch on every rank (chapter 06)
    # HINT 2: DistributedSampler(train_set, num_replicas=me.world_size, rank=me.rank, shuffle=True, seed=seed) as the DataLoader's sampler, with drop_last=True in the DataLoader
    # BEGIN SOLUTION: return this rank's loader: its own shard of a shuffled order that every rank agrees on (a new one each epoch after set_epoch), in full batches of batch_per_rank
    sampler = DistributedSampler(train_set, num_replicas=me.world_size, rank=me.rank, shuffle=True, seed=seed)
    return DataLoader(train_set, batch_size=batch_per_rank, sampler=sampler, drop_last=True)
    # END SOLUTION


AUGMENT = v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))


def augment_seed(seed: int, rank: int, epoch: int, step: int) -> int:
    """One seed per (rank, epoch, step): ranks augment differently, and a resumed run redoes
    step s of epoch e exactly as the uninterrupted run did."""
    return ((seed * 1_000 + rank) * 10_000 + epoch) * 1_000_000 + step


def augment(images: torch.Tensor, seed: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """A random small rotation, shift and zoom of every image, drawn from `seed` alone; this rank's
    random streams (on the CPU and on `device`, the one the rank trains on) are left as they were."""
    # HINT 1: AUGMENT draws from torch's global generator: seed it inside torch.random.fork_rng, which puts back the generators it is given; one image at a time (a batch would share one draw)
    # HINT 2: torch.manual_seed also seeds every GPU, so give fork_rng this rank's GPU too: devices=[device] when device.type == "cuda", else []
    # BEGIN SOLUTION: return the augmented batch, every image with its own draw, the whole batch determined by `seed` alone, every random stream of this rank as it was before
    rank_devices = [device] if device.type == "cuda" else []  # every generator manual_seed touches here
    with torch.random.fork_rng(devices=rank_devices):
        torch.manual_seed(seed)
        return torch.stack([AUGMENT(image) for image in images])
    # END SOLUTION


# --- Model: a small CNN with synchronized BatchNorm, wrapped in DDP -------------------------------


def build_model(net: nn.Module, me: Rank) -> DDP:
    """The network with its BatchNorm synchronized over all ranks, on this rank's device, in DDP."""
    # HINT 1: three steps, in this order: synchronize the BatchNorm layers, move to the device, wrap in DDP (chapters 01 and 07)
    # HINT 2: convert_sync_batchnorm(net) (nn.SyncBatchNorm on nccl, ringside's on gloo); .to(me.device); DDP(net, device_ids=[me.device.index] on a GPU, None on the CPU)
    # BEGIN SOLUTION: return the network in DDP on me.device, its BatchNorm layers computing their statistics over all ranks' batches
    net = convert_sync_batchnorm(net).to(me.device)
    model = DDP(net, device_ids=[me.device.index] if me.device.type == "cuda" else None)
    # END SOLUTION
    model.register_comm_hook(None, rank_ordered_mean)
    return model


def train_step(model: DDP, images: torch.Tensor, labels: torch.Tensor, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, dtype: torch.dtype | None) -> torch.Tensor:
    """One optimizer step on this rank's batch; returns the loss (detached)."""
    # HINT 1: the forward and the loss under autocast (when dtype is not None); the backward and the step through the scaler, which may skip a step whose gradients hold an inf; the gradients zeroed for the next step (chapter 09)
    # HINT 2: with torch.autocast(images.device.type, dtype=dtype or torch.float32, enabled=dtype is not None): loss = ...; scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)
    # BEGIN SOLUTION: one mixed-precision step on this batch: forward and loss in `dtype` (full precision when None), gradients through the scaler (a step with inf or NaN gradients is skipped and the scale adapts), gradients cleared afterwards
    with torch.autocast(images.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = F.cross_entropy(model(images), labels)
    scaler.scale(loss).backward()  # DDP averages the gradients over the ranks during backward
    scaler.step(optimizer)  # unscales; skips the step if a gradient is inf or NaN
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    # END SOLUTION
    return loss.detach()


# --- Checkpoints: everything a resumed run needs, written atomically ------------------------------


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to `path` so that a crash mid-write never leaves a broken file at `path`."""
    # HINT 1: write the whole file under another name first, and only then put it in place with one atomic rename; if saving fails, nothing may be left behind
    # HINT 2: torch.save into path.with_name(f".{path.name}.tmp") opened with open(...), f.flush() and os.fsync(f.fileno()), then os.replace(tmp, path); on an exception, tmp.unlink(missing_ok=True) and raise again
    # BEGIN SOLUTION: write `state` to `path` so that whatever happens mid-write, `path` holds either the previous checkpoint or the new one, and no partial file stays behind
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # END SOLUTION


def read_checkpoint(path: Path, device: torch.device) -> dict:
    """Load a checkpoint's tensors onto `device`, refusing anything that is not plain data."""
    # HINT 1: a checkpoint is a pickle: loading one from elsewhere may run code, unless torch.load is told to accept plain data only
    # HINT 2: torch.load(path, map_location=device, weights_only=True)
    # BEGIN SOLUTION: return the checkpoint's contents with their tensors on `device`, refusing (raising) on anything that is not tensors and plain containers
    return torch.load(path, map_location=device, weights_only=True)
    # END SOLUTION


def checkpoint_state(model: DDP, optimizer, scheduler, scaler, progress: Progress, me: Rank) -> dict:
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "progress": asdict(progress), "world_size": me.world_size}


def restore(state: dict, model: DDP, optimizer, scheduler, scaler) -> Progress:
    """Put every piece of training state back; return where the run stopped."""
    # HINT 1: everything that changes while training must come back: the weights and buffers, the optimizer's momentum, the scheduler's step count, the scaler's scale, and where the run was
    # HINT 2: model.module.load_state_dict, optimizer.load_state_dict, scheduler.load_state_dict, scaler.load_state_dict; return Progress(**state["progress"])
    # BEGIN SOLUTION: put every piece of training state in `state` back into the objects, and return where the run stopped
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    return Progress(**state["progress"])
    # END SOLUTION


# --- Evaluation: every test image exactly once, over all ranks ------------------------------------


@torch.no_grad()
def evaluate(net: nn.Module, test_set: TensorDataset, me: Rank, batch_size: int = 256) -> dict:
    """Exact loss and accuracy over the whole test set; every rank evaluates a part.

    Takes the bare network (model.module): DDP's forward may talk to the other ranks, and ranks
    with different numbers of test batches would then wait for each other forever."""
    was_training = net.training
    net.eval()
    # HINT 1: DistributedSampler pads the shards with duplicates: take every world_size-th index yourself instead; add up sums and counts, never means (chapter 10)
    # HINT 2: mine = torch.arange(me.rank, len(test_set), me.world_size); per batch add [cross_entropy(..., reduction="sum"), correct, count] into one float64 tensor on me.device; dist.all_reduce it
    # BEGIN SOLUTION: set `totals` to float64 [loss sum, correct, count] over the whole test set, each image counted exactly once across the ranks, the same on every rank
    mine = torch.arange(me.rank, len(test_set), me.world_size)
    totals = torch.zeros(3, dtype=torch.float64, device=me.device)  # loss sum, correct, count
    for batch in mine.split(batch_size):
        images, labels = (t.to(me.device) for t in test_set[batch])
        logits = net(images).float()
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                               (logits.argmax(1) == labels).sum().double(),
                               torch.tensor(len(labels), dtype=torch.float64, device=me.device)])
    dist.all_reduce(totals)
    # END SOLUTION
    net.train(was_training)
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count, "correct": int(correct), "count": int(count)}


# --- The training script --------------------------------------------------------------------------


def train(args: argparse.Namespace, me: Rank, before_step=None) -> Result:
    """The whole run; resumes from OUT/checkpoint.pt when it exists (unless --fresh): a job that
    torchrun restarts, or that is launched again by hand, continues where the last checkpoint left
    it. A finished run removes its checkpoint (final.pt keeps the weights)."""
    out = Path(args.out)
    ckpt = out / "checkpoint.pt"
    resuming = checkpoint_found(ckpt, me, fresh=args.fresh)  # rank 0 looks, and tells every rank

    train_set, test_set = load_data(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's too)
    if me.device.type == "cuda":  # bit-exact resumes need deterministic convolution kernels (chapter 08)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    loader = make_train_loader(train_set, args.batch_size // me.world_size, args.seed, me)
    model = build_model(make_net(train_set.tensors[0].shape[1]), me)
    lr = args.lr * args.batch_size / 64  # scaled with the global batch (chapter 06)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    dtype = amp_dtype(args, me)
    scaler = torch.amp.GradScaler(me.device.type, enabled=dtype == torch.float16)  # bfloat16 needs none

    progress, resumed_from = Progress(), None
    if resuming:
        state = read_checkpoint(ckpt, me.device)
        require_same_world_size(state, me, ckpt)
        progress = restore(state, model, optimizer, scheduler, scaler)
        resumed_from = progress.global_step
        print0(f"resumed from {ckpt} at epoch {progress.epoch}, step {progress.global_step}")

    bar = progress_bar(args, me, total=total_steps, done=progress.global_step)
    steps_run = 0
    for epoch in range(progress.epoch, args.epochs):
        model.train()
        # HINT 1: the sampler's order depends on the epoch it was told; a resumed run must not redo the batches of this epoch it already did
        # HINT 2: loader.sampler.set_epoch(epoch); batches = itertools.islice(loader, progress.step_in_epoch, None)
        # BEGIN SOLUTION: set `batches` to this epoch's batches in the order every rank agrees on (a new one each epoch, the same on a rerun), without those a resumed run already did
        loader.sampler.set_epoch(epoch)
        batches = itertools.islice(loader, progress.step_in_epoch, None)
        # END SOLUTION
        for images, labels in batches:
            if resumed_from is None:
                maybe_die(args, me, progress.global_step)
            if before_step is not None:  # the self-check's probe: it sees each batch
                before_step(progress, images, labels)
            images = augment(images, augment_seed(args.seed, me.rank, epoch, progress.step_in_epoch), me.device)
            loss = train_step(model, images.to(me.device), labels.to(me.device), optimizer, scaler, dtype)
            scheduler.step()
            dist.all_reduce(loss)  # for the log only: the mean loss over the ranks
            progress.loss_sum += loss.item() / me.world_size
            progress.step_in_epoch += 1
            progress.global_step += 1
            steps_run += 1
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{loss.item() / me.world_size:.3f}")
            if progress.global_step % args.checkpoint_every == 0 and me.is_main:
                save_checkpoint(ckpt, checkpoint_state(model, optimizer, scheduler, scaler, progress, me))

        test = evaluate(model.module, test_set, me)
        progress.history.append({"epoch": epoch, "train_loss": progress.loss_sum / progress.step_in_epoch,
                                 "test_loss": test["loss"], "test_accuracy": test["accuracy"]})
        progress.epoch, progress.step_in_epoch, progress.loss_sum = epoch + 1, 0, 0.0
        if me.is_main:
            save_checkpoint(ckpt, checkpoint_state(model, optimizer, scheduler, scaler, progress, me))
            bar.write(f"epoch {epoch + 1}/{args.epochs}: train loss {progress.history[-1]['train_loss']:.2f}, "
                      f"test accuracy {test['accuracy']:.2f}", file=sys.stdout)
    bar.close()

    test = evaluate(model.module, test_set, me)
    if me.is_main:
        save_checkpoint(out / "final.pt", model.module.state_dict())
        save_history(progress.history, out)  # history.json and curves.png
        ckpt.unlink(missing_ok=True)  # finished: a later run in this folder starts afresh
    return Result(model, loader, progress, resumed_from, steps_run, test)


if __name__ == "__main__":  # the check is in checks/lab11.py: you need not read it
    from checks import lab11
    lab11.run(make_train_loader=make_train_loader, augment=augment, build_model=build_model, train_step=train_step,
              save_checkpoint=save_checkpoint, read_checkpoint=read_checkpoint, checkpoint_state=checkpoint_state,
              restore=restore, evaluate=evaluate, train=train)
