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

from ringside import Checks, Rank, print0, run_lab
from ringside.compare import max_diff


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
    # HINT 2: stack [count, sum, sum of squares] per channel into one tensor, all_reduce it with SUM, then mean = sum / count and var = sum_sq / count - mean**2
    # BEGIN SOLUTION: return (count, mean, biased variance) per channel over every rank's samples, as if one process held the global batch; the ranks' batch sizes may differ
    dims = reduce_dims(x)
    local_sum = x.sum(dims)
    local = torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (x * x).sum(dims)])
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    count, total, total_sq = local
    mean = total / count
    var = total_sq / count - mean * mean
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
    """nn.BatchNorm2d whose training forward synchronizes across ranks; evaluation is unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                           self.eps, self.momentum)


# --- The self-check: compare with nn.BatchNorm2d on the whole global batch, in one process --------

# EPS far above BatchNorm's default 1e-5, so that a misplaced or missing eps shows
CHANNELS, SIZE, SEED, MOMENTUM, EPS = 3, 4, 7, 0.3, 0.1
# Relative tolerance: float32 sums taken in another order than BatchNorm's; measured about 1e-7 apart
# (1e-6 relative for weight gradients, sums of ~400 terms). Every classic mistake is off by 1e-3 or more.
TOL = 1e-5


def batch_sizes(world_size: int) -> list[int]:
    """Unequal per-rank batches (2, 5, 8, 11 on 4 ranks): a mean of means would be wrong."""
    return [2 + 3 * r for r in range(world_size)]


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch and the upstream gradient, drawn from one seed: every rank makes the same."""
    g = torch.Generator().manual_seed(SEED)
    n = sum(batch_sizes(world_size))
    x = 2.0 + 1.5 * torch.randn(n, CHANNELS, SIZE, SIZE, generator=g)
    probe = torch.randn(n, CHANNELS, SIZE, SIZE, generator=g)  # loss = sum(output * probe)
    return x, probe


def my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    sizes = batch_sizes(world_size)
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def make_bn(cls: type[nn.BatchNorm2d]) -> nn.BatchNorm2d:
    bn = cls(CHANNELS, eps=EPS, momentum=MOMENTUM)
    with torch.no_grad():  # weight and bias away from 1 and 0, so their mistakes show
        bn.weight.copy_(torch.tensor([0.5, 1.5, -2.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return bn


def reference(world_size: int) -> dict[str, torch.Tensor]:
    """One process, nn.BatchNorm2d, the global batch: what every rank's part must equal."""
    x, probe = global_batch(world_size)
    x.requires_grad_(True)
    bn = make_bn(nn.BatchNorm2d)
    out = bn(x)
    (out * probe).sum().backward()
    return {"output": out.detach(), "running_mean": bn.running_mean, "running_var": bn.running_var,
            "grad_input": x.grad, "grad_weight": bn.weight.grad, "grad_bias": bn.bias.grad}


def mine(rank: int, world_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's slice through HandSyncBatchNorm2d; weight/bias gradients summed over ranks."""
    x, probe = global_batch(world_size)
    x = my_slice(x, rank, world_size).to(device).requires_grad_(True)
    probe = my_slice(probe, rank, world_size).to(device)
    bn = make_bn(HandSyncBatchNorm2d).to(device)
    out = bn(x)
    (out * probe).sum().backward()
    grads = torch.stack([bn.weight.grad, bn.bias.grad])
    dist.all_reduce(grads, op=dist.ReduceOp.SUM)  # what DDP does (then divides by world size)
    result = {"output": out, "running_mean": bn.running_mean, "running_var": bn.running_var,
              "grad_input": x.grad, "grad_weight": grads[0], "grad_bias": grads[1]}
    return {name: t.detach().cpu() for name, t in result.items()}


def mean_of_means(world_size: int) -> torch.Tensor:
    """The classic wrong global mean: every rank's own mean, averaged, whatever its batch size."""
    x, _ = global_batch(world_size)
    return torch.stack([my_slice(x, r, world_size).mean((0, 2, 3)) for r in range(world_size)]).mean(0)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to TOL relative to the size of b (gradients of weight and bias are sums of ~400 terms)."""
    return max_diff(a, b) <= TOL * (1 + b.abs().max().item())


def not_finite(got: dict) -> list[str]:
    return [name for name, t in got.items() if not torch.isfinite(t).all()]


def forward_variants(rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, str]]:
    """This rank's output as the classic forward mistakes compute it, each with its hint."""
    x, _ = global_batch(world_size)
    part = my_slice(x, rank, world_size)
    weight, bias = make_bn(nn.BatchNorm2d).weight.detach(), make_bn(nn.BatchNorm2d).bias.detach()
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    n = x.numel() // CHANNELS

    def out(m, inv):
        return (part - per_channel(m, part)) * per_channel(inv, part) * per_channel(weight, part) + per_channel(bias, part)

    with torch.no_grad():
        unsynced = make_bn(nn.BatchNorm2d)(part)
    return {
        "unsynced": (unsynced, "it equals BatchNorm on this rank's batch alone - are the statistics all_reduced?"),
        "unbiased": (out(mean, torch.rsqrt(var * n / (n - 1) + EPS)),
                     "it is normalized with the unbiased variance - normalize with the biased one (sum_sq / count - "
                     "mean**2); only running_var stores the unbiased variance"),
        "eps outside": (out(mean, 1 / (var.sqrt() + EPS)), "eps was added after the square root - "
                                                           "x_hat = (x - mean) / sqrt(var + eps)"),
        "no eps": (out(mean, torch.rsqrt(var)), "eps was left out - x_hat = (x - mean) / sqrt(var + eps)"),
        "no affine": (out(mean, torch.rsqrt(var + EPS)) / per_channel(weight, part) - per_channel(bias / weight, part),
                      "the output is x_hat without weight and bias - return x_hat * weight + bias"),
    }


def check_forward(checks: Checks, got: dict, ref: dict, rank: int, world_size: int) -> None:
    expected = my_slice(ref["output"], rank, world_size)
    if close(got["running_mean"], MOMENTUM * mean_of_means(world_size)):
        hint = ("the mean is the average of the ranks' means, but the batches have unequal sizes "
                f"{batch_sizes(world_size)} - are you averaging means instead of weighting by count? "
                "all_reduce the count, the sum and the sum of squares")
    else:
        hint = next((h for t, h in forward_variants(rank, world_size).values() if close(got["output"], t)),
                    "check mean = sum / count, var = sum_sq / count - mean**2 (biased), "
                    "x_hat = (x - mean) / sqrt(var + eps)")
    checks.expect(close(got["output"], expected), f"output differs from BatchNorm on the global batch by "
                                                  f"{max_diff(got['output'], expected):.2e}: {hint}")
    untouched = torch.equal(got["running_mean"], torch.zeros(CHANNELS)) and torch.equal(got["running_var"],
                                                                                        torch.ones(CHANNELS))
    if untouched:
        checks.fail("running_mean and running_var still hold their initial 0 and 1: assigning "
                    "`running_mean = ...` only rebinds a local name - update the buffers in place "
                    "(running_mean.mul_(1 - momentum).add_(...), or .copy_())")
        return
    global_mean = ref["running_mean"] / MOMENTUM  # the reference started from 0
    if close(got["running_mean"], (1 - MOMENTUM) * global_mean):
        hint = ("momentum is the weight of the new value: running = (1 - momentum) * running + "
                "momentum * batch statistic (PyTorch's convention, the opposite of an optimizer's)")
    else:
        hint = "running_mean = (1 - momentum) * running_mean + momentum * global mean"
    checks.expect(close(got["running_mean"], ref["running_mean"]),
                  f"running_mean differs by {max_diff(got['running_mean'], ref['running_mean']):.2e}: {hint}")
    n = sum(batch_sizes(world_size)) * SIZE * SIZE
    start = 1 - MOMENTUM  # what is left of the initial running_var of 1 after one step
    unbiased = (ref["running_var"] - start) / MOMENTUM
    biased = start + (ref["running_var"] - start) * (n - 1) / n
    if close(got["running_var"], biased):
        hint = ("it matches the biased variance - BatchNorm stores the unbiased one in running_var: "
                "multiply the variance by count / (count - 1) first")
    elif close(got["running_var"], MOMENTUM + (1 - MOMENTUM) * unbiased):
        hint = ("momentum is the weight of the new value: running = (1 - momentum) * running + "
                "momentum * batch statistic (PyTorch's convention, the opposite of an optimizer's)")
    else:
        hint = "running_var = (1 - momentum) * running_var + momentum * unbiased global variance"
    checks.expect(close(got["running_var"], ref["running_var"]),
                  f"running_var differs by {max_diff(got['running_var'], ref['running_var']):.2e}: {hint}")


def grad_input_variants(rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, str]]:
    """This rank's input gradient as the classic backward mistakes compute it, each with its hint."""
    x, dy_all = global_batch(world_size)
    weight = make_bn(nn.BatchNorm2d).weight.detach()
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    invstd = torch.rsqrt(var + EPS)
    x_hat_all = (x - per_channel(mean, x)) * per_channel(invstd, x)
    x_hat, dy = my_slice(x_hat_all, rank, world_size), my_slice(dy_all, rank, world_size)
    big, mine = x.numel() // CHANNELS, dy.numel() // CHANNELS
    dims = (0, 2, 3)
    total_dy, total_dyx = dy_all.sum(dims), (dy_all * x_hat_all).sum(dims)
    own_dy, own_dyx = dy.sum(dims), (dy * x_hat).sum(dims)

    def grad(sum_dy, sum_dyx, count, scale=weight * invstd, mean_term=True, xhat_term=True):
        g = dy.clone()
        if mean_term:
            g = g - per_channel(sum_dy / count, dy)
        if xhat_term:
            g = g - x_hat * per_channel(sum_dyx / count, dy)
        return per_channel(scale, dy) * g

    missing = ("sum(dy) and sum(dy * x_hat) are this rank's only - is there an all_reduce missing in backward? "
               "Both must be summed over every rank and divided by the global count")
    return {
        "local sums": (grad(own_dy, own_dyx, big), missing),
        "local sums, local count": (grad(own_dy, own_dyx, mine), missing),
        "local count": (grad(total_dy, total_dyx, mine), "the sums are global but divided by this rank's count - "
                                                        "divide by the global count (the all_reduced one)"),
        "averaged": (grad(total_dy / world_size, total_dyx / world_size, big),
                     "the sums were averaged over the ranks (ReduceOp.AVG?) - all_reduce them with SUM"),
        "no weight": (grad(total_dy, total_dyx, big, scale=invstd), "the weight factor is missing - multiply by "
                                                                    "weight * invstd"),
        "no invstd": (grad(total_dy, total_dyx, big, scale=weight), "the 1 / sqrt(var + eps) factor is missing - "
                                                                    "multiply by weight * invstd"),
        "no mean term": (grad(total_dy, total_dyx, big, mean_term=False),
                         "the term of the mean is missing - subtract sum(dy) / count"),
        "no x_hat term": (grad(total_dy, total_dyx, big, xhat_term=False),
                          "the term of the variance is missing - subtract x_hat * sum(dy * x_hat) / count"),
        "plain": (grad(total_dy, total_dyx, big, mean_term=False, xhat_term=False),
                  "that is the gradient as if mean and variance were constants - subtract sum(dy) / count and "
                  "x_hat * sum(dy * x_hat) / count (both over the global batch)"),
    }


def check_backward(checks: Checks, got: dict, ref: dict, rank: int, world_size: int) -> None:
    expected = my_slice(ref["grad_input"], rank, world_size)
    if not close(got["output"], my_slice(ref["output"], rank, world_size)):
        hint = "the output is wrong too: fix the forward first"
    else:
        hint = next((h for t, h in grad_input_variants(rank, world_size).values() if close(got["grad_input"], t)),
                    "grad_x = weight * invstd * (dy - sum_dy / count - x_hat * sum_dy_xhat / count), with both "
                    "sums over the global batch")
    checks.expect(close(got["grad_input"], expected),
                  f"the input gradient differs by {max_diff(got['grad_input'], expected):.2e}: {hint}")
    if close(got["grad_weight"], ref["grad_bias"]) and close(got["grad_bias"], ref["grad_weight"]):
        checks.fail("grad_weight and grad_bias are swapped: grad_weight = sum(dy * x_hat), grad_bias = sum(dy)")
        return
    for name in ("grad_weight", "grad_bias"):
        if close(got[name], world_size * ref[name]):
            hint = (f"it is {world_size}x too large after summing over ranks - return this rank's own "
                    f"sum, not the all_reduced one (DDP averages parameter gradients itself)")
        else:
            hint = "grad_weight = sum(dy * x_hat), grad_bias = sum(dy), over this rank's values"
        checks.expect(close(got[name], ref[name]), f"{name} (summed over ranks) differs from BatchNorm's by "
                                                   f"{max_diff(got[name], ref[name]):.2e}: {hint}")


def main(me: Rank, checks: Checks) -> None:
    got = mine(me.rank, me.world_size, me.device)
    ref = reference(me.world_size)
    print0(f"per-rank batch sizes {batch_sizes(me.world_size)}, {CHANNELS} channels of {SIZE}x{SIZE}")
    expected_shapes = {name: tuple(my_slice(t, me.rank, me.world_size).shape if name in ("output", "grad_input")
                                   else t.shape) for name, t in ref.items()}
    wrong = [f"{name} {tuple(got[name].shape)} (expected {shape})" for name, shape in expected_shapes.items()
             if tuple(got[name].shape) != shape]
    if wrong:  # no comparison can run on tensors of another shape
        checks.fail(f"wrong shapes: {', '.join(wrong)} - per-channel statistics have shape (C,), the output and "
                    f"the input gradient the shape of x")
        return
    broken = not_finite(got)
    if broken:  # NaN or inf is a finding of its own: no comparison can say more
        checks.fail(f"{', '.join(broken)} hold NaN or inf: the square root of a negative variance - is the "
                    f"count all_reduced together with the sums (a global sum over this rank's count makes "
                    f"mean**2 larger than sum_sq / count)? - or a division by a zero count")
        return
    check_forward(checks, got, ref, me.rank, me.world_size)
    check_backward(checks, got, ref, me.rank, me.world_size)


if __name__ == "__main__":
    run_lab(main, title="Lab 07 (syncbn)")
