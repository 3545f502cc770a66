"""Lab 07 - syncbn: synchronized BatchNorm as an autograd Function, equal to BatchNorm on the global batch.

Run it with 4 processes:
    make lab CH=07 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/07_syncbn.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/07_syncbn.py; edit that one.)

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function


def per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector of shape (C,) reshaped to broadcast against x of shape (N, C, ...)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension of x except the channels (dim 1): BatchNorm's statistics run over these."""
    return [0, *range(2, x.dim())]


def global_channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) per channel over the samples of *every* rank.

    count is how many values each channel has on all ranks together (batch x pixels), as a tensor.
    The ranks may hold different batch sizes: weight each rank by its count."""
    # (stuck? `make hint CH=07` prints hint 1 of 2; run it again for the next)
    # TODO: return (count, mean, biased variance) per channel over every rank's samples, as if one process held the global batch; the ranks' batch sizes may differ, a rank may hold no sample, and a channel's mean may be large against its spread (1000 and 0.5)
    raise NotImplementedError("the TODO above")
    return count, mean, var


class SyncBatchNormFunction(Function):
    """BatchNorm in training mode whose statistics (and gradients) span every rank."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        count, mean, var = global_channel_stats(x)
        # (stuck? `make hint CH=07` prints hint 1 of 2; run it again for the next)
        # TODO: update the running statistics exactly as nn.BatchNorm2d does, return BatchNorm's output computed with the global statistics, and save what backward needs
        raise NotImplementedError("the TODO above")

    @staticmethod
    def backward(ctx, grad_out):
        # (stuck? `make hint CH=07` prints hint 1 of 2; run it again for the next)
        # TODO: return the gradients of x, weight and bias: the input gradient of normalizing over the global batch, and this rank's own weight and bias gradients (DDP averages those itself)
        raise NotImplementedError("the TODO above")
        return grad_x, grad_weight, grad_bias, None, None, None, None


class HandSyncBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d whose training forward synchronizes across ranks; evaluation is unchanged.
    It takes nn.BatchNorm2d's options (momentum=None, affine=False, track_running_stats=False) and
    hands the Function what it expects whatever they are: weight and bias (ones and zeros without
    affine), running buffers (throwaway ones when none are kept) and the momentum of this step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # the running statistics, or (without them) this rank's batch, as nn.SyncBatchNorm
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average over the batches seen, as nn.BatchNorm2d keeps it
                momentum = 1.0 / float(self.num_batches_tracked)
            running_mean, running_var = self.running_mean, self.running_var
        else:
            running_mean, running_var = x.new_zeros(self.num_features), x.new_ones(self.num_features)
        weight = self.weight if self.affine else x.new_ones(self.num_features)
        bias = self.bias if self.affine else x.new_zeros(self.num_features)
        return SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, self.eps, momentum)


if __name__ == "__main__":  # the check is in checks/lab07.py: you need not read it
    from checks import lab07
    lab07.run(per_channel=per_channel, global_channel_stats=global_channel_stats,
              HandSyncBatchNorm2d=HandSyncBatchNorm2d)
