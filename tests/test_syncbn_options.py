"""Lab 07's HandSyncBatchNorm2d is a drop-in nn.BatchNorm2d: its options (momentum=None, affine=False,
track_running_stats=False), a rank with no sample and a channel whose mean is large against its spread
give what nn.BatchNorm2d gives on the global batch (what nn.SyncBatchNorm gives). The lab's check judges
the learner's Function; this tests the given forward that hands the Function its arguments."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringside import run_ranks
from ringside.launch import ROOT


def solution():
    spec = importlib.util.spec_from_file_location("solution_07_syncbn", ROOT / "solutions" / "07_syncbn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def differences(rank: int, world_size: int, options: dict, sizes: list[int], hard: bool) -> list[str]:
    """Two training steps and one in evaluation, against nn.BatchNorm2d on the global batch."""
    lab = solution()
    mine, theirs = lab.HandSyncBatchNorm2d(2, **options), nn.BatchNorm2d(2, **options)
    wrong = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(sum(sizes), 2, 3, 3, generator=g)
        if hard:  # channel 0: mean 1000, std 0.5, float32
            x = x * torch.tensor([0.5, 2.0]).view(1, 2, 1, 1) + torch.tensor([1000.0, -3.0]).view(1, 2, 1, 1)
        probe = torch.randn(x.shape, generator=g)
        start = sum(sizes[:rank])
        part = x[start:start + sizes[rank]].clone().requires_grad_()
        whole = x.clone().requires_grad_()
        if step == 2:
            mine.eval(), theirs.eval()
            part = x[start:start + sizes[rank]]  # evaluation: theirs on this rank's batch, as nn.SyncBatchNorm
            out_mine, out_theirs = mine(part), theirs(part)
            if not torch.allclose(out_mine, out_theirs, rtol=1e-4, atol=1e-3):
                wrong.append("eval output")
            continue
        out_mine, out_theirs = mine(part), theirs(whole)
        (out_mine * probe[start:start + sizes[rank]]).sum().backward()
        (out_theirs * probe).sum().backward()
        pairs = {"output": (out_mine, out_theirs[start:start + sizes[rank]]),
                 "input gradient": (part.grad, whole.grad[start:start + sizes[rank]])}
        pairs.update({name: (a, b) for (name, a), (_, b) in zip(mine.named_buffers(), theirs.named_buffers())})
        for name, (a, b) in pairs.items():
            if not torch.allclose(a.detach().double(), b.detach().double(), rtol=1e-4, atol=1e-3):
                wrong.append(f"step {step + 1}: {name}")
    if mine.weight is not None:
        grads = torch.stack([mine.weight.grad, mine.bias.grad])
        dist.all_reduce(grads)
        if not torch.allclose(grads, torch.stack([theirs.weight.grad, theirs.bias.grad]), rtol=1e-4, atol=1e-3):
            wrong.append("weight and bias gradients")
    return wrong


@pytest.mark.parametrize("options, sizes, hard", [
    ({"momentum": None}, [3, 5], False),
    ({"affine": False}, [3, 5], False),
    ({"track_running_stats": False}, [3, 5], False),
    ({"momentum": 0.3}, [0, 4], True),  # a rank with no sample, and a channel at mean 1000, std 0.5
], ids=["momentum_None", "affine_False", "track_running_stats_False", "empty_rank_large_mean"])
def test_hand_sync_batchnorm_is_a_drop_in(options, sizes, hard):
    results = run_ranks(differences, 2, options, sizes, hard, show_output=False, timeout=120)
    assert results == [[], []], results
