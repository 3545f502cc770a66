"""What went wrong on a GPU box (one H100, torch 2.11) and can be shown here, on a CPU.

Each test reproduces the cause on this machine (pretending CUDA is there where that is the cause)
and holds the course's answer to it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ringside import RankError, run_ranks


def powersgd_steps(rank, world_size, cuda_said):
    """Two PowerSGD steps on CPU buckets, with torch.cuda.is_available() answering `cuda_said`."""
    torch.cuda.is_available = lambda: cuda_said  # a forked rank: the test process keeps its own
    if cuda_said:  # as on a GPU machine, where CUDA initializes: what remains is the hook's own mistake
        torch.cuda._lazy_init = lambda: None
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(3):  # plain all-reduces for the first 2 steps, then compression
        model(torch.randn(4, 8)).sum().backward()
    return "trained"


def test_powersgd_on_cpu_buckets_fails_where_cuda_is_available_and_chapter_12_hides_it():
    """REVIEW A: chapter 12's comm-hook cell failed on the GPU box with "Expected a cuda device, but got:
    cpu": powerSGD_hook synchronizes the bucket's device whenever CUDA is available (powerSGD_hook.py,
    decompress; torch 2.11 and 2.14.1). The chapter's ranks, which train on the CPU, say CUDA is absent."""
    with pytest.raises(RankError, match="Expected a cuda device, but got: cpu"):
        run_ranks(powersgd_steps, 2, True, show_output=False, timeout=60)
    assert run_ranks(powersgd_steps, 2, False, show_output=False, timeout=60) == ["trained"] * 2
    cells = json.loads((ROOT / "chapters" / "12_ddp_internals.ipynb").read_text())["cells"]
    hooked = "".join(next(c["source"] for c in cells if "def train_with_hook" in "".join(c["source"])))
    assert "torch.cuda.is_available = lambda: False" in hooked


def test_the_capstone_runs_of_chapter_11_are_pinned_to_one_backend():
    """REVIEW A: on a 1-GPU box, 1 rank took nccl + CUDA + bf16 and 2 and 4 ranks gloo + fp32, silently."""
    cells = json.loads((ROOT / "chapters" / "11_capstone.ipynb").read_text())["cells"]
    runner = "".join(next(c["source"] for c in cells if "def run_job" in "".join(c["source"])))
    assert 'env={"RINGSIDE_BACKEND": "gloo"}' in runner


def test_no_stored_output_names_the_torch_version():
    """REVIEW A: notebooks 10, 12 and 14 printed `torch 2.14.1`, which a GPU box's own torch 2.11 does
    not (a cell whose output is ignored, chapter 00's inventory, may). A stored measurement names the
    torch it was made with on a line that says "measured" (chapters 09 and 15): that is data."""
    running = f"torch {torch.__version__.split('+')[0]}"
    for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code" or "nbval-ignore-output" in cell.get("metadata", {}).get("tags", []):
                continue
            lines = "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])).splitlines()
            named = [line for line in lines if running in line and "measured" not in line]
            assert not named, f"{path.name}: {named[0][:200]}"
