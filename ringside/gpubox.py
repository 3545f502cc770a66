"""A rehearsal of `make lab` on a GPU machine, on this CPU-only one (tests only: RINGSIDE_GPU_BOX=1).

Each lab's check runs the learner's functions once more on a stand-in GPU (ringside.effects.rank_gpu),
but everything else a rank does - the check's own collectives that make every rank agree, run_lab's
setup, the solution's main - runs on the CPU with gloo. On a GPU machine the default group is nccl,
which has no CPU backend: a check that all_reduces a CPU tensor crashes there ("No backend type
associated with device type cpu"), whatever the learner wrote. `rehearse()`, called first thing in
every rank (ringside.launch's forked ranks, when RINGSIDE_GPU_BOX=1), makes the whole process a GPU
machine's rank from its start to its end:

- a `StandInGPU` with LOCAL_WORLD_SIZE stand-in GPUs (current device cuda:0 until set_device, as a
  fresh process's), so pick_backend() answers ("nccl", "cuda") and Rank.device is cuda:LOCAL_RANK;
- `init_process_group("nccl", device_id=...)` and `new_group()` make real gloo groups underneath,
  while `dist.get_backend()` answers what a GPU machine answers (nccl, unless gloo was asked for);
- a `Recorder` around everything (its `for_gloo` hands gloo the CPU data): a collective or send/recv
  on an nccl group handed a tensor not on cuda:LOCAL_RANK raises NCCL's refusal, and so does an object
  collective while torch.cuda.current_device() is not this rank's GPU (torch moves its pickled bytes to
  the current device on nccl: see `standin.refusal`). Inside a check's own GPU pass of the learner's
  code (rank_gpu) the learner's misplaced tensor is noted as before, so that the check names it;
- StandInDDP averages the gradients as DDP does (a communication hook gets one bucket of them all).

What the stand-in cannot run a check says in one line (effects.beyond_stand_in) and goes on: lab 08's
draws from a torch.Generator(device="cuda"), lab 16's wrapper (its saved-tensor hooks run below Python).
Lab 11 cannot be rehearsed: nn.SyncBatchNorm, which it takes on nccl, runs CUDA kernels only
(batch_norm_stats), and autocast on "cuda" does not reach the CPU data of stand-in tensors.

    RINGSIDE_GPU_BOX=1 python -m ringside 2 solutions/17_diloco.py     # as `make lab` on a 2-GPU machine
"""

from __future__ import annotations

import os

import torch.distributed as dist

from .calls import Recorder
from .standin import _BOX, StandInGPU

SWITCH = "RINGSIDE_GPU_BOX"


class _Everything(Recorder):
    """The rehearsal's Recorder: every call goes through `for_gloo`; none is kept (a whole run's)."""

    def _note(self, name, signature, args, kwargs):
        call = super()._note(name, signature, args, kwargs)
        self.calls.clear()
        self.ops.clear()
        return call


def rehearse() -> None:
    """From now to the process's end this rank is a GPU machine's rank (see the module docstring)."""
    if _BOX:
        return
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    count = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1)
    backends = {}  # group -> the backend asked for (None: the default group's)
    real_init, real_new_group, real_get_backend = dist.init_process_group, dist.new_group, dist.get_backend

    def init_process_group(backend=None, *args, device_id=None, **kwargs):
        real_init("gloo", *args, **kwargs)  # (device_id: the GPU nccl binds to; gloo has none)
        backends[None] = str(backend or "nccl")

    def new_group(ranks=None, *args, backend=None, device_id=None, **kwargs):
        group = real_new_group(ranks, *args, backend="gloo", **kwargs)
        backends[group] = str(backend or backends.get(None, "nccl"))
        return group

    def get_backend(group=None):
        if group is None or group is dist.group.WORLD:
            return backends.get(None) or real_get_backend(group)
        return backends.get(group) or real_get_backend(group)

    def backend_of(group) -> str:
        return get_backend(None if group is dist.group.WORLD else group)

    for name, value in (("init_process_group", init_process_group), ("new_group", new_group),
                        ("get_backend", get_backend)):
        setattr(dist, name, value)  # the public names: torch's own code keeps calling c10d's
    _BOX.update(backend_of=backend_of, rank_gpu=local_rank)
    StandInGPU(devices=count, current=0).__enter__()
    _Everything().__enter__()
