"""Lab 12 - DDP by hand, the way DDP does it: gradient buckets, all-reduces that overlap backward,
and gradient accumulation that skips communication.

A hook on every parameter fires as soon as its gradient is ready. Gradients are grouped into
buckets (in reverse registration order, because backward produces the last layer's gradients
first); when a bucket's last gradient arrives, the hook launches an asynchronous all-reduce of the
whole bucket and returns at once, so the communication runs while backward computes the rest.
Before the optimizer step, training waits for every bucket and divides by the world size, once.
Inside `no_sync()` the hooks do nothing: the gradients of the micro-batches just accumulate.

The check trains the same model with torch's own DistributedDataParallel (and its `no_sync`) on
the same micro-batches and compares; it also records the order of events (gradient ready,
all-reduce launched, waited on, optimizer step) to see that your all-reduces overlap backward.

Run it with 4 processes:
    make lab CH=12 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/12_ddp_internals.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/12_ddp_internals.py; edit that one.)

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ringside.data import digits

SEED = 0
LR = 0.1
WINDOWS = 4          # optimizer steps
ACCUM = 3            # micro-batches accumulated per step
MICRO_BATCH = 8      # samples per rank per micro-batch
BUCKET_CAP = 4000    # elements per bucket (DDP counts megabytes: bucket_cap_mb, 25 by default)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights in every process and in the check
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


# --- Your part: buckets, the gradient hook, the wait, no_sync, one accumulation window ------------


def make_buckets(params: list[torch.Tensor], cap: int) -> list[list[int]]:
    """Group the parameters' indices into buckets, the way DDP's reducer does.

    Walk the parameters in REVERSE registration order (backward produces the last layer's
    gradients first). Add each index to the current bucket; once the bucket holds at least `cap`
    elements (sum of numel), close it and start a new one. Every index lands in exactly one bucket;
    the last bucket may be smaller than `cap`. Example: numels [100, 10, 100, 10], cap 50
    -> [[3, 2], [1, 0]]."""
    # (stuck? `make hint CH=12` prints hint 1 of 2; run it again for the next)
    # TODO: return the list of buckets (lists of parameter indices), filled in reverse registration order, each closed once it holds >= cap elements
    raise NotImplementedError("the TODO above")


class HandDDP(nn.Module):
    """A data-parallel wrapper with DDP's reducer written out: buckets, hooks, async all-reduces.

    Like torch's DDP it starts every rank from rank 0's parameters and buffers (frozen ones too),
    reduces only the parameters that require gradients, broadcasts rank 0's buffers at a forward
    that follows a synchronizing forward, and decides at the FORWARD whether the coming backward
    communicates (so the forward of an accumulation step must run inside no_sync(), as DDP says).
    Buckets are launched strictly in index order, so every rank issues the same all-reduces in the
    same order (on NCCL, a different order hangs or mixes up buckets). A parameter that got no
    gradient in a backward counts as a zero gradient, as with DDP(find_unused_parameters=True);
    where DDP leaves a parameter that no rank used at grad None, this one gives it zeros."""

    def __init__(self, module: nn.Module, bucket_cap: int = BUCKET_CAP):
        super().__init__()
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones are never reduced
        with torch.no_grad():  # every rank starts from rank 0's state, as DDP does: weights and buffers
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.buckets = make_buckets(self.params, bucket_cap)  # lists of indices into self.params
        self.sync = True                      # False inside no_sync()
        self.reduce_this_backward = True      # decided at each forward: was sync on? (the hooks obey this)
        self.sync_buffers = True              # broadcast rank 0's buffers at the next forward?
        # (stuck? `make hint CH=12` prints hint 1 of 2; run it again for the next)
        # TODO: set up the state that your gradient hook, launch_bucket and finish_gradient_sync share to track one backward's buckets - you design it
        raise NotImplementedError("the TODO above")
        for index, p in enumerate(self.params):
            # Called by autograd right after p.grad has been accumulated during backward.
            p.register_post_accumulate_grad_hook(lambda p, index=index: self.on_gradient_ready(index))

    def forward(self, *args, **kwargs):
        # DDP decides here, not at backward: a forward inside no_sync() makes its backward local.
        if self.sync_buffers:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=0)
        self.reduce_this_backward = self.sync
        self.sync_buffers = self.sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block, forward-and-backward only accumulates gradients locally: no communication."""
        # (stuck? `make hint CH=12` prints hint 1 of 2; run it again for the next)
        # TODO: make every forward inside the block one whose backward stays local, and sync on again afterwards, even if the block raises
        raise NotImplementedError("the TODO above")

    def on_gradient_ready(self, index: int) -> None:
        """Autograd calls this inside backward, once self.params[index].grad holds this backward's
        gradient. The contract: in a backward whose forward ran with sync on (self.reduce_this_backward),
        each bucket is handed to launch_bucket exactly once, as soon as all of its gradients have
        arrived - but never before every lower-numbered bucket, so all ranks issue the same
        all-reduces in the same order; in a backward that does not reduce, nothing happens. Must
        return at once: never wait for communication here."""
        # (stuck? `make hint CH=12` prints hint 1 of 3; run it again for the next)
        # TODO: in a reducing backward, hand every bucket to launch_bucket once, as soon as it is complete, in bucket index order only; return at once, never wait
        raise NotImplementedError("the TODO above")

    def launch_bucket(self, bucket: int) -> None:
        """Start the sum over all ranks of bucket `bucket`'s gradients - one all-reduce of one flat
        buffer, a parameter without a .grad counting as zeros - and return without waiting for it,
        keeping whatever finish_gradient_sync will need to wait for it and read the result."""
        # (stuck? `make hint CH=12` prints hint 1 of 2; run it again for the next)
        # TODO: start one asynchronous all-reduce (sum) of the bucket's gradients, zeros for a missing one, and remember it for finish_gradient_sync; never wait here
        raise NotImplementedError("the TODO above")

    def finish_gradient_sync(self) -> None:
        """Call after the last backward of a window (one that reduced), before optimizer.step().
        The contract: when it returns, every bucket has been all-reduced exactly once in this
        backward, in index order; every reduced parameter's .grad holds the average over all ranks
        of its gradient (a parameter that had no .grad gets one); and the object is ready for the
        next window's backward."""
        # (stuck? `make hint CH=12` prints hint 1 of 3; run it again for the next)
        # TODO: make every reduced .grad the average over all ranks, each bucket all-reduced exactly once and in index order, then leave the object ready for the next window
        raise NotImplementedError("the TODO above")


def train_window(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list,
                 loss_of: Callable) -> None:
    """One optimizer step from ACCUM micro-batches (gradient accumulation).

    `loss_of(model, batch)` returns the micro-batch's loss, already divided by the number of
    micro-batches. Works for HandDDP and for torch's DDP (both have no_sync)."""
    # (stuck? `make hint CH=12` prints hint 1 of 2; run it again for the next)
    # TODO: take one optimizer step on the averaged gradients of all the micro-batches, communicating in the last backward only, and leave the gradients zeroed for the next window
    raise NotImplementedError("the TODO above")


# --- Training your DDP on this rank's micro-batches -----------------------------------------------


def rank_micro_batches(rank: int, world_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank's micro-batches, window by window: a different slice of the digits on each rank."""
    x, y = digits().tensors
    per_window = ACCUM * MICRO_BATCH * world_size
    windows = []
    for w in range(WINDOWS):
        start = w * per_window + rank * ACCUM * MICRO_BATCH
        windows.append([(x[s:s + MICRO_BATCH], y[s:s + MICRO_BATCH])
                        for s in range(start, start + ACCUM * MICRO_BATCH, MICRO_BATCH)])
    return windows


def train(model: HandDDP, windows: list, device: torch.device, events: list, after_first: Callable) -> None:
    """WINDOWS steps of train_window, noting forward passes, steps and window ends in `events`;
    `after_first()` runs just before the first step (to look at the gradients)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()

    def loss_of(model, batch):
        x, y = batch
        output = model(x.to(device))
        events.append(("forward", getattr(model, "reduce_this_backward", True)))  # will its backward reduce?
        return loss_fn(output, y.to(device)) / len(windows[0])

    def first_step(*_):
        after_first()
        handle.remove()

    optimizer.register_step_pre_hook(lambda *_: events.append(("step",)))
    handle = optimizer.register_step_pre_hook(first_step)
    for micro_batches in windows:
        train_window(model, optimizer, micro_batches, loss_of)
        events.append(("window end",))


if __name__ == "__main__":  # the check is in checks/lab12.py: you need not read it
    from checks import lab12
    lab12.run(LR=LR, WINDOWS=WINDOWS, ACCUM=ACCUM, BUCKET_CAP=BUCKET_CAP, make_model=make_model,
              make_buckets=make_buckets, HandDDP=HandDDP, rank_micro_batches=rank_micro_batches, train=train)
