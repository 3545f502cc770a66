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
# SOLUTION FILE

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
    # HINT 1: reversed(range(len(params))) walks the indices from the last parameter to the first.
    # HINT 2: keep `current` (a list of indices) and `size` (its element count); append `current` to the result when size >= cap, and once more at the end if it is not empty.
    # BEGIN SOLUTION: return the list of buckets (lists of parameter indices), filled in reverse registration order, each closed once it holds >= cap elements
    buckets, current, size = [], [], 0
    for index in reversed(range(len(params))):
        current.append(index)
        size += params[index].numel()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


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
        # HINT 1: the hook must know which bucket a gradient belongs to, how many of that bucket's gradients have arrived in this backward, and which bucket is next in line to launch; finish_gradient_sync must find every launched all-reduce again (its Work, its buffer, its bucket).
        # HINT 2: self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}; self.ready = [0] * len(self.buckets); self.launched = 0 (the next bucket to launch); self.pending = [] (one (work, flat, bucket) per launched all-reduce).
        # BEGIN SOLUTION: set up the state that your gradient hook, launch_bucket and finish_gradient_sync share to track one backward's buckets - you design it
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self.ready = [0] * len(self.buckets)  # how many gradients of each bucket have arrived
        self.launched = 0                     # buckets launched in this backward: 0, 1, ... in order
        self.pending = []                     # (work, flat buffer, bucket) of launched all-reduces
        # END SOLUTION
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
        # HINT 1: forward() copies self.sync into self.reduce_this_backward, which the hook reads.
        # HINT 2: self.sync = False; try: yield; finally: self.sync = True
        # BEGIN SOLUTION: make every forward inside the block one whose backward stays local, and sync on again afterwards, even if the block raises
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
        # END SOLUTION

    def on_gradient_ready(self, index: int) -> None:
        """Autograd calls this inside backward, once self.params[index].grad holds this backward's
        gradient. The contract: in a backward whose forward ran with sync on (self.reduce_this_backward),
        each bucket is handed to launch_bucket exactly once, as soon as all of its gradients have
        arrived - but never before every lower-numbered bucket, so all ranks issue the same
        all-reduces in the same order; in a backward that does not reduce, nothing happens. Must
        return at once: never wait for communication here."""
        # HINT 1: a bucket is complete when as many of its gradients have arrived as it holds parameters; a bucket that completes early must wait until the ones before it have gone out.
        # HINT 2: return at once unless self.reduce_this_backward; count the arrival in its bucket; then launch bucket after bucket, starting at the next one in line, while the next one in line is complete.
        # HINT 3: self.ready[self.bucket_of[index]] += 1; while self.launched < len(self.buckets) and self.ready[self.launched] == len(self.buckets[self.launched]): self.launch_bucket(self.launched); self.launched += 1
        # BEGIN SOLUTION: in a reducing backward, hand every bucket to launch_bucket once, as soon as it is complete, in bucket index order only; return at once, never wait
        if not self.reduce_this_backward:
            return
        self.ready[self.bucket_of[index]] += 1
        while (self.launched < len(self.buckets)
               and self.ready[self.launched] == len(self.buckets[self.launched])):
            self.launch_bucket(self.launched)
            self.launched += 1
        # END SOLUTION

    def launch_bucket(self, bucket: int) -> None:
        """Start the sum over all ranks of bucket `bucket`'s gradients - one all-reduce of one flat
        buffer, a parameter without a .grad counting as zeros - and return without waiting for it,
        keeping whatever finish_gradient_sync will need to wait for it and read the result."""
        # HINT 1: torch.cat of the gradients' reshape(-1) copies them into one new buffer; a parameter whose .grad is None contributes torch.zeros_like(p). all_reduce with async_op=True returns a Work at once.
        # HINT 2: work = dist.all_reduce(flat, async_op=True); self.pending.append((work, flat, bucket)) - never work.wait() here.
        # BEGIN SOLUTION: start one asynchronous all-reduce (sum) of the bucket's gradients, zeros for a missing one, and remember it for finish_gradient_sync; never wait here
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in (self.params[i] for i in self.buckets[bucket])]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, async_op=True)
        self.pending.append((work, flat, bucket))
        # END SOLUTION

    def finish_gradient_sync(self) -> None:
        """Call after the last backward of a window (one that reduced), before optimizer.step().
        The contract: when it returns, every bucket has been all-reduced exactly once in this
        backward, in index order; every reduced parameter's .grad holds the average over all ranks
        of its gradient (a parameter that had no .grad gets one); and the object is ready for the
        next window's backward."""
        # HINT 1: a parameter that got no gradient never completes its bucket, nor lets the buckets after it go out: those are still waiting here. An async all-reduce's buffer holds the sum only once its Work's wait() has returned.
        # HINT 2: launch the buckets still waiting, in order; then for each launched all-reduce: wait, divide the buffer by the world size, copy each parameter's slice back into its .grad; last, reset what the hook counted.
        # HINT 3: offset = 0; for i in self.buckets[bucket]: p = self.params[i]; average = flat[offset:offset + p.numel()].view_as(p); p.grad.copy_(average) (or p.grad = average.clone() when None); offset += p.numel()
        # BEGIN SOLUTION: make every reduced .grad the average over all ranks, each bucket all-reduced exactly once and in index order, then leave the object ready for the next window
        while self.launched < len(self.buckets):
            self.launch_bucket(self.launched)
            self.launched += 1
        world_size = dist.get_world_size()
        for work, flat, bucket in self.pending:
            work.wait()
            flat /= world_size
            offset = 0
            for i in self.buckets[bucket]:
                p = self.params[i]
                average = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = average.clone()
                else:
                    p.grad.copy_(average)
                offset += p.numel()
        self.ready = [0] * len(self.buckets)
        self.launched = 0
        self.pending = []
        # END SOLUTION


def train_window(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list,
                 loss_of: Callable) -> None:
    """One optimizer step from ACCUM micro-batches (gradient accumulation).

    `loss_of(model, batch)` returns the micro-batch's loss, already divided by the number of
    micro-batches. Works for HandDDP and for torch's DDP (both have no_sync)."""
    # HINT 1: only the last micro-batch's backward may communicate; its hooks launch every bucket. A HandDDP's gradients are averaged only once finish_gradient_sync() has returned.
    # HINT 2: for batch in micro_batches[:-1]: with model.no_sync(): loss_of(model, batch).backward(); then the last one outside, then finish_gradient_sync() if isinstance(model, HandDDP), step, zero_grad.
    # BEGIN SOLUTION: take one optimizer step on the averaged gradients of all the micro-batches, communicating in the last backward only, and leave the gradients zeroed for the next window
    for batch in micro_batches[:-1]:
        with model.no_sync():
            loss_of(model, batch).backward()
    loss_of(model, micro_batches[-1]).backward()
    if isinstance(model, HandDDP):
        model.finish_gradient_sync()
    optimizer.step()
    optimizer.zero_grad()
    # END SOLUTION


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
