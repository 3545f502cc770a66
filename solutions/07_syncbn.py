"""Lab 07 - syncbn: synchronized BatchNorm as an autograd Function, equal to BatchNorm on the global batch.

Run it with 4 processes:
    make lab CH=07 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/07_syncbn.py)
"""
# SOLUTION FILE

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
    # HINT 1: a rank with a bigger batch must weigh more: add up quantities that add (counts, sums, sums of squares), never means
    # HINT 2: stack [count, sum, sum of squares] per channel into one float64 tensor (in float32, sum_sq / count - mean**2 loses the variance's digits when the mean is large against the spread), all_reduce it with SUM, then mean = sum / count and var = sum_sq / count - mean**2, returned in x's dtype
    # BEGIN SOLUTION: return (count, mean, biased variance) per channel over every rank's samples, as if one process held the global batch; the ranks' batch sizes may differ, a rank may hold no sample, and a channel's mean may be large against its spread (1000 and 0.5)
    dims = reduce_dims(x)
    wide = x.double()  # float64 sums: sum_sq / count - mean**2 keeps the digits that float32 would lose
    local_sum = wide.sum(dims)
    local = torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (wide * wide).sum(dims)])
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    count, total, total_sq = local
    mean = total / count
    var = total_sq / count - mean * mean
    count, mean, var = count.to(x.dtype), mean.to(x.dtype), var.to(x.dtype)
    # END SOLUTION
    return count, mean, var


class SyncBatchNormFunction(Function):
    """BatchNorm in training mode whose statistics (and gradients) span every rank."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        count, mean, var = global_channel_stats(x)
        # HINT 1: running_mean and running_var are the module's buffers: change them in place (mul_, add_), since assigning to the name only rebinds a local variable; BatchNorm stores the unbiased variance there
        # HINT 2: running = (1 - momentum) * running + momentum * stat, with stat = mean or var * count / (count - 1); x_hat = (x - mean) * rsqrt(var + eps) with the biased var; ctx.save_for_backward(x_hat, weight, invstd, count)
        # BEGIN SOLUTION: update the running statistics exactly as nn.BatchNorm2d does, return BatchNorm's output computed with the global statistics, and save what backward needs
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * var * count / (count - 1))
        invstd = torch.rsqrt(var + eps)
        x_hat = (x - per_channel(mean, x)) * per_channel(invstd, x)
        ctx.save_for_backward(x_hat, weight, invstd, count)
        return x_hat * per_channel(weight, x) + per_channel(bias, x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        # HINT 1: every x moved the global mean and variance, so each input's gradient depends on two per-channel sums over the whole global batch: sum(dy) and sum(dy * x_hat)
        # HINT 2: all_reduce (SUM) both sums in one tensor; grad_x = weight * invstd * (dy - sum_dy / count - x_hat * sum_dy_xhat / count); grad_weight = sum(dy * x_hat) and grad_bias = sum(dy) over this rank only
        # BEGIN SOLUTION: return the gradients of x, weight and bias: the input gradient of normalizing over the global batch, and this rank's own weight and bias gradients (DDP averages those itself)
        x_hat, weight, invstd, count = ctx.saved_tensors
        dims = reduce_dims(grad_out)
        local_sums = torch.stack([grad_out.sum(dims), (grad_out * x_hat).sum(dims)])
        grad_weight, grad_bias = local_sums[1].clone(), local_sums[0].clone()
        dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)
        sum_dy, sum_dy_xhat = local_sums
        grad_x = per_channel(weight * invstd, grad_out) * (
            grad_out - per_channel(sum_dy / count, grad_out) - x_hat * per_channel(sum_dy_xhat / count, grad_out)
        )
        # END SOLUTION
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
