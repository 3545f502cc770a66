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
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/11_capstone.py; edit that one.)

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
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: return this rank's loader: its own shard of a shuffled order that every rank agrees on (a new one each epoch after set_epoch), in full batches of batch_per_rank
    raise NotImplementedError("the TODO above")


AUGMENT = v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))


def augment_seed(seed: int, rank: int, epoch: int, step: int) -> int:
    """One seed per (rank, epoch, step): ranks augment differently, and a resumed run redoes
    step s of epoch e exactly as the uninterrupted run did."""
    return ((seed * 1_000 + rank) * 10_000 + epoch) * 1_000_000 + step


def augment(images: torch.Tensor, seed: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """A random small rotation, shift and zoom of every image, drawn from `seed` alone; this rank's
    random streams (on the CPU and on `device`, the one the rank trains on) are left as they were."""
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: return the augmented batch, every image with its own draw, the whole batch determined by `seed` alone, every random stream of this rank as it was before
    raise NotImplementedError("the TODO above")


# --- Model: a small CNN with synchronized BatchNorm, wrapped in DDP -------------------------------


def build_model(net: nn.Module, me: Rank) -> DDP:
    """The network with its BatchNorm synchronized over all ranks, on this rank's device, in DDP."""
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: return the network in DDP on me.device, its BatchNorm layers computing their statistics over all ranks' batches
    raise NotImplementedError("the TODO above")
    model.register_comm_hook(None, rank_ordered_mean)
    return model


def train_step(model: DDP, images: torch.Tensor, labels: torch.Tensor, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, dtype: torch.dtype | None) -> torch.Tensor:
    """One optimizer step on this rank's batch; returns the loss (detached)."""
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: one mixed-precision step on this batch: forward and loss in `dtype` (full precision when None), gradients through the scaler (a step with inf or NaN gradients is skipped and the scale adapts), gradients cleared afterwards
    raise NotImplementedError("the TODO above")
    return loss.detach()


# --- Checkpoints: everything a resumed run needs, written atomically ------------------------------


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to `path` so that a crash mid-write never leaves a broken file at `path`."""
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: write `state` to `path` so that whatever happens mid-write, `path` holds either the previous checkpoint or the new one, and no partial file stays behind
    raise NotImplementedError("the TODO above")


def read_checkpoint(path: Path, device: torch.device) -> dict:
    """Load a checkpoint's tensors onto `device`, refusing anything that is not plain data."""
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: return the checkpoint's contents with their tensors on `device`, refusing (raising) on anything that is not tensors and plain containers
    raise NotImplementedError("the TODO above")


def checkpoint_state(model: DDP, optimizer, scheduler, scaler, progress: Progress, me: Rank) -> dict:
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "progress": asdict(progress), "world_size": me.world_size}


def restore(state: dict, model: DDP, optimizer, scheduler, scaler) -> Progress:
    """Put every piece of training state back; return where the run stopped."""
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: put every piece of training state in `state` back into the objects, and return where the run stopped
    raise NotImplementedError("the TODO above")


# --- Evaluation: every test image exactly once, over all ranks ------------------------------------


@torch.no_grad()
def evaluate(net: nn.Module, test_set: TensorDataset, me: Rank, batch_size: int = 256) -> dict:
    """Exact loss and accuracy over the whole test set; every rank evaluates a part.

    Takes the bare network (model.module): DDP's forward may talk to the other ranks, and ranks
    with different numbers of test batches would then wait for each other forever."""
    was_training = net.training
    net.eval()
    # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
    # TODO: set `totals` to float64 [loss sum, correct, count] over the whole test set, each image counted exactly once across the ranks, the same on every rank
    raise NotImplementedError("the TODO above")
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
        # (stuck? `make hint CH=11` prints hint 1 of 2; run it again for the next)
        # TODO: set `batches` to this epoch's batches in the order every rank agrees on (a new one each epoch, the same on a rerun), without those a resumed run already did
        raise NotImplementedError("the TODO above")
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
