"""Data-parallel training with DDP and torchrun: a template to copy and adapt to your own model.

Plain PyTorch, the standard library and tqdm: nothing from the course. The parts you replace for your
own work are `build_datasets`, `build_model`, `loss_fn` and (maybe) `build_optimizer`; see
template/README.md. Everything else (the process group, sharding, mixed precision, accumulation,
exact evaluation, checkpoints, resume, SIGTERM) works as is on CPUs (gloo) and GPUs (nccl).

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

Run the same command again and it resumes from OUT/checkpoint.pt if there is one (a new --out starts
afresh). `kill -TERM` (Slurm's preemption signal) saves a checkpoint at the next step and exits.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import os
import random
import signal
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from tqdm import tqdm

log = logging.getLogger("train_ddp")


# --- Distributed setup: everything about processes and devices, in one place ---------------------


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
    # torchrun keeps ONE key-value store for the whole job, restarts included, and the processes of
    # a crashed attempt leave their addresses in it: a restarted rank could read a dead address.
    # So each attempt gets keys of its own. Its number cannot come from TORCHELASTIC_RESTART_COUNT
    # (torchrun counts restarts per machine, and machines disagree): every process counts itself in
    # once, and the attempt is the count divided by the world size - the same on every machine.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    attempt = (store.add("train_ddp/joined", 1) - 1) // world_size
    store = dist.PrefixStore(f"train_ddp/attempt_{attempt}", store)
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
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def loss_fn(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, labels)


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


def settle_bucket_order(model: DDP, batch) -> None:
    """A forward and backward that change nothing, so that DDP fixes its gradient buckets now.

    After the first backward, DDP re-orders its buckets to the order in which gradients got ready.
    That moves gradients to other places in the all-reduce, and with 3 or more ranks the sums then
    round differently in the last bit: a resumed run would drift from an uninterrupted one. Doing it
    here, in every run, makes every real step use the same buckets. (eval(): BatchNorm's running
    statistics stay as they are.)"""
    images, labels = batch
    model.eval()
    loss_fn(model(images.to(next(model.parameters()).device)), labels.to(next(model.parameters()).device)).backward()
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
    """Exact loss and accuracy over the validation set; each rank takes indices rank, rank + W, ...

    (DistributedSampler would pad the last round with duplicates.) Takes the bare network, not the
    DDP wrapper: ranks may run different numbers of batches, and DDP's forward talks to the others."""
    was_training = net.training
    net.eval()
    mine = Subset(val_set, range(rank, len(val_set), world_size))
    loader = DataLoader(mine, batch_size=args.batch_size, num_workers=0, pin_memory=device.type == "cuda")
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            outputs = net(images)
        sums[0] += F.cross_entropy(outputs.float(), labels, reduction="sum").double()
        sums[1] += (outputs.argmax(1) == labels).sum()
        sums[2] += len(labels)
    dist.all_reduce(sums)
    net.train(was_training)
    return {"loss": (sums[0] / sums[2]).item(), "accuracy": (sums[1] / sums[2]).item(), "count": int(sums[2])}


# --- Training ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP training with torchrun (see the docstring for commands)")
    p.add_argument("--out", default="runs/train_ddp", help="checkpoints and results (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm; 0: no clipping")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="auto: bf16 on GPUs that run it natively (Ampere+), else fp16 + GradScaler; off on the CPU")
    p.add_argument("--sync-bn", action="store_true",
                   help="BatchNorm statistics over all processes (nccl only: gloo has no SyncBatchNorm)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=50, help="optimizer steps between checkpoints")
    p.add_argument("--log-every", type=int, default=20,
                   help="optimizer steps between log lines (and checks for SIGTERM)")
    p.add_argument("--timeout-s", type=float, default=600,
                   help="how long a collective may wait for the other ranks before failing")
    p.add_argument("--pretrained", default=None, help="initial weights (ignored when resuming)")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="testing: --fail-rank kills itself (SIGKILL) before this step, once per --out")
    p.add_argument("--fail-rank", type=int, default=0)
    return p.parse_args(argv)


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


STOP_REQUESTED = False


def ignore_sigterm(worker_id: int) -> None:
    """In DataLoader workers: torchrun and Slurm signal every process, and a worker killed by SIGTERM
    would crash the training process before it can save."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def request_stop(signum, frame) -> None:
    global STOP_REQUESTED
    STOP_REQUESTED = True  # acted on at the next step boundary, where the state is consistent


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.timeout_s)
    is_main = rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, request_stop)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # Reproducible: the same seed gives the same initial weights, data order and augmentation.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    train_set, val_set = build_datasets(args.seed)
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=False,  # new workers each epoch see the dataset's new epoch
                        generator=torch.Generator().manual_seed(args.seed),  # leaves the global RNG alone
                        worker_init_fn=ignore_sigterm)
    steps_per_epoch = len(sampler) // args.batch_size // args.accum
    if steps_per_epoch == 0:
        raise SystemExit(f"an epoch has fewer than {args.accum} batches of {args.batch_size} per process")
    total_steps = steps_per_epoch * args.epochs

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
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer, scheduler = build_optimizer(model, args, total_steps)
    amp_dtype = pick_amp(args.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bf16 needs none

    ckpt, best_path = out / "checkpoint.pt", out / "best.pt"
    step, best_acc = 0, -1.0  # step: optimizer steps done
    # Resume if a checkpoint exists. Rank 0 looks and tells the others, so that all ranks decide alike.
    found = torch.tensor([ckpt.exists()], dtype=torch.int32, device=device)
    dist.broadcast(found, src=0)
    if found.item():
        state = torch.load(ckpt, map_location=device, weights_only=True)  # FileNotFoundError: --out not shared
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        step, best_acc = state["step"], state["best_acc"]
        if len(state["rng"]) == world_size:
            set_rng_state(state["rng"][rank], device)
        log.info("resumed from %s at step %d (epoch %d)", ckpt, step, step // max(1, steps_per_epoch))

    def save_checkpoint() -> None:
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state(device))  # every rank's generators (e.g. for dropout)
        if is_main:
            save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                         "step": step, "best_acc": best_acc, "rng": rngs}, ckpt)

    settle_bucket_order(model, next(iter(DataLoader(val_set, batch_size=2))))
    log.info("%d process(es), backend %s, device %s, autocast %s, %d steps of %d x %d x %d samples",
             world_size, dist.get_backend(), device.type, amp_dtype, total_steps, world_size,
             args.accum, args.batch_size)
    bar = tqdm(total=total_steps, initial=step, unit="step", disable=True if not is_main else None)
    stopped = False
    while step < total_steps and not stopped:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        train_set.epoch = epoch  # the augmentation's epoch (workers get a fresh copy each epoch)
        sampler.skip = done_in_epoch * args.accum * args.batch_size  # mid-epoch resume
        model.train()
        micro_batches = iter(loader)
        for _ in range(done_in_epoch, steps_per_epoch):
            if args.fail_at_step == step and rank == args.fail_rank:
                marker = out / f".failed_at_step_{step}"  # die only once, whatever restarts follow
                if not marker.exists():
                    marker.touch()
                    log.warning("rank %d: killing myself (SIGKILL) before step %d", rank, step)
                    logging.shutdown()
                    os.kill(os.getpid(), signal.SIGKILL)
            loss_sum = torch.zeros((), device=device)
            for k in range(args.accum):
                images, labels = next(micro_batches)
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                last = k == args.accum - 1
                with model.no_sync() if not last else nullcontext():  # all-reduce once per step
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                        loss = loss_fn(model(images), labels) / args.accum
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            if args.clip_grad > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # skipped if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update()
            if step % args.log_every and step % args.checkpoint_every:
                continue  # no .item() here: the CPU runs ahead of the GPU between these points
            # Every few steps, one small all-reduce: the mean loss for the log, and whether any rank
            # got SIGTERM (all ranks must agree to stop at the same step).
            flags = torch.stack([loss_sum.float(), torch.tensor(float(STOP_REQUESTED), device=device)])
            dist.all_reduce(flags)
            if step % args.log_every == 0:
                log.info("step %d/%d  loss %.4f  lr %.4f", step, total_steps, flags[0].item() / world_size,
                         scheduler.get_last_lr()[0])
            if flags[1].item() > 0:
                save_checkpoint()
                log.info("SIGTERM: saved %s at step %d; run the same command to resume", ckpt, step)
                stopped = True
                break
            if step % args.checkpoint_every == 0 and step % steps_per_epoch != 0:  # (epoch ends save below)
                save_checkpoint()
        if stopped:
            break
        if step % steps_per_epoch == 0:  # an epoch ended: validate, keep the best, checkpoint
            val = evaluate(model.module, val_set, rank, world_size, device, args, amp_dtype)
            log.info("epoch %d: val loss %.4f, accuracy %.4f", step // steps_per_epoch, val["loss"], val["accuracy"])
            if val["accuracy"] > best_acc:
                best_acc = val["accuracy"]
                if is_main:
                    save_atomic({"model": model.module.state_dict(), "step": step, "accuracy": best_acc}, best_path)
            save_checkpoint()
    bar.close()

    if not stopped:
        val = evaluate(model.module, val_set, rank, world_size, device, args, amp_dtype)
        digest = weights_sha256(model.module)
        log.info("final: val accuracy %.4f, loss %.4f, weights sha256 %s", val["accuracy"], val["loss"], digest[:16])
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
