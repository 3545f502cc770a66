"""Synchronized BatchNorm that runs on the CPU (gloo), and a converter that picks the right one.

`nn.SyncBatchNorm` only trains on GPUs ("SyncBatchNorm expected input tensor to be on GPU").
This is the same idea, small enough to read: in training, every rank adds up, per channel,
the count, the sum and the sum of squares of its batch; one all_reduce gives the statistics of
the global batch. Backward all-reduces the two sums that the input gradient needs. The weight
and bias gradients stay local, as in PyTorch's own: DDP averages them like any other gradient.

    model = convert_sync_batchnorm(model)   # nn.SyncBatchNorm on nccl, this one otherwise

Chapter 07 derives it by hand; chapter 11 trains with it. Why a second copy of lab 07's answer:
the capstone must run before the learner has finished lab 07, so it cannot import the learner's
file, and this one adds what a real model needs (a module with running statistics, eval mode,
momentum=None, the converter). tests/test_11_capstone.py holds it to BatchNorm on the gathered batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def _channel_shape(x: torch.Tensor) -> list[int]:
    """(1, C, 1, 1, ...): broadcasts a per-channel vector over x."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class SyncBatchNormFunction(torch.autograd.Function):
    """BatchNorm over the batches of all ranks together (training mode)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        dims = [0] + list(range(2, x.dim()))  # every dimension but the channels
        xf = x.float()
        local_count = xf.numel() // xf.shape[1]
        # One all_reduce of [count, sum per channel, sum of squares per channel], in float64 so
        # that E[x^2] - E[x]^2 does not lose the digits that float32 would.
        stats = torch.cat([
            torch.tensor([local_count], dtype=torch.float64, device=x.device),
            xf.sum(dims, dtype=torch.float64),
            (xf.double() ** 2).sum(dims),
        ])
        _all_reduce(stats, group)
        channels = x.shape[1]
        count = stats[0]
        mean = stats[1:1 + channels] / count
        var = (stats[1 + channels:] / count - mean ** 2).clamp_min(0)  # biased: normalizes the batch
        invstd = torch.rsqrt(var + eps).float()
        mean, var = mean.float(), var.float()
        if running_mean is not None:
            unbiased = var * (count / (count - 1)).float()
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = _channel_shape(x)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = xhat * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(xhat, weight, invstd, count.float())
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight, invstd, count = ctx.saved_tensors
        dims = [0] + list(range(2, xhat.dim()))
        shape = _channel_shape(xhat)
        dy = grad_out.float()
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        # The input gradient needs both sums over the *global* batch: one all_reduce.
        channels = xhat.shape[1]
        both = _all_reduce(torch.cat([sum_dy, sum_dy_xhat]), ctx.group)
        mean_dy, mean_dy_xhat = both[:channels] / count, both[channels:] / count
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        grad_weight = grad_bias = None
        if weight is not None:  # local, like nn.SyncBatchNorm: DDP averages them across ranks
            grad_weight, grad_bias = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)
        return grad_x.to(grad_out.dtype), grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training statistics are those of the batches of all ranks."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return super().forward(x)  # evaluation uses the running statistics: nothing to sync
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as in nn.BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        track = self.training and self.track_running_stats
        return SyncBatchNormFunction.apply(
            x, self.weight, self.bias,
            self.running_mean if track else None, self.running_var if track else None,
            self.eps, momentum, self.process_group,
        )


def convert_sync_batchnorm(module: nn.Module, backend: str | None = None, process_group=None) -> nn.Module:
    """Replace every BatchNorm layer by a synchronized one: PyTorch's nn.SyncBatchNorm on nccl
    (it needs GPUs), this module's SyncBatchNorm otherwise. Parameters and buffers are kept."""
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend == "nccl":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group)
        with torch.no_grad():
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, backend, process_group))
    return module


__all__ = ["SyncBatchNorm", "SyncBatchNormFunction", "convert_sync_batchnorm"]
