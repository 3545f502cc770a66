"""Comparing tensors across ranks and against a reference, with the tolerance said out loud."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters of a model (or a DDP wrapper) as one detached CPU vector."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients of a model as one detached CPU vector (zeros where a gradient is missing)."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
        for p in model.parameters()
    ])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference (inf when the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def all_gather_tensor(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of a same-shaped tensor, in rank order, on every rank (on t's device).

    nccl only moves CUDA tensors, so on nccl the exchange happens on this rank's GPU."""
    wire = t.contiguous()
    if dist.get_backend() == "nccl":
        wire = wire.to(torch.device("cuda", torch.cuda.current_device()))
    copies = [torch.empty_like(wire) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, wire)
    return [c.to(t.device) for c in copies]


def equal_on_all_ranks(t: torch.Tensor, atol: float = 0.0) -> bool:
    """True when every rank holds the same tensor (to atol)."""
    return all(max_diff(t, other) <= atol for other in all_gather_tensor(t))
