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
    # TODO: stack this rank's count, sum and sum of squares per channel, all_reduce them (SUM), then mean = sum / count and var = sum_sq / count - mean**2
    raise NotImplementedError("the TODO above")
    return count, mean, var


class SyncBatchNormFunction(Function):
    """BatchNorm in training mode whose statistics (and gradients) span every rank."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        count, mean, var = global_channel_stats(x)
        # TODO: update running_mean and running_var in place as BatchNorm does (var made unbiased with count / (count - 1)), then normalize x with the global mean and var, scale by weight, shift by bias; save what backward needs
        raise NotImplementedError("the TODO above")

    @staticmethod
    def backward(ctx, grad_out):
        # TODO: sum dy and dy * x_hat per channel over this rank, all_reduce both (SUM); grad_x = weight * invstd * (dy - sum_dy / count - x_hat * sum_dy_xhat / count); grad_weight and grad_bias are this rank's own sums (DDP averages them)
        raise NotImplementedError("the TODO above")
        return grad_x, grad_weight, grad_bias, None, None, None, None


class HandSyncBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d whose training forward synchronizes across ranks; evaluation is unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                           self.eps, self.momentum)


# ---- the self-check: compare with nn.BatchNorm2d on the whole global batch, in one process ----

CHANNELS, SIZE, SEED, MOMENTUM = 3, 4, 7, 0.3
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
    bn = cls(CHANNELS, momentum=MOMENTUM)
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


def check_forward(checks: Checks, got: dict, ref: dict, rank: int, world_size: int) -> None:
    x, _ = global_batch(world_size)
    with torch.no_grad():
        unsynced = make_bn(nn.BatchNorm2d)(my_slice(x, rank, world_size))  # this rank's batch alone
    expected = my_slice(ref["output"], rank, world_size)
    if close(got["output"], unsynced):
        hint = "it equals BatchNorm on this rank's batch alone - are the statistics all_reduced?"
    elif close(got["running_mean"], MOMENTUM * mean_of_means(world_size)):
        hint = ("the mean is the average of the ranks' means, but the batches have unequal sizes "
                f"{batch_sizes(world_size)} - are you averaging means instead of weighting by count? "
                "all_reduce the count, the sum and the sum of squares")
    else:
        hint = "check mean = sum / count, var = sum_sq / count - mean**2 (biased), x_hat = (x - mean) / sqrt(var + eps)"
    checks.expect(close(got["output"], expected), f"output differs from BatchNorm on the global batch by "
                                                  f"{max_diff(got['output'], expected):.2e}: {hint}")
    checks.expect(close(got["running_mean"], ref["running_mean"]),
                  f"running_mean differs by {max_diff(got['running_mean'], ref['running_mean']):.2e}: "
                  f"running_mean = (1 - momentum) * running_mean + momentum * global mean")
    n = sum(batch_sizes(world_size)) * SIZE * SIZE
    start = 1 - MOMENTUM  # what is left of the initial running_var of 1 after one step
    biased = start + (ref["running_var"] - start) * (n - 1) / n
    if close(got["running_var"], biased):
        hint = ("it matches the biased variance - BatchNorm stores the unbiased one in running_var: "
                "multiply the variance by count / (count - 1) first")
    else:
        hint = "running_var = (1 - momentum) * running_var + momentum * unbiased global variance"
    checks.expect(close(got["running_var"], ref["running_var"]),
                  f"running_var differs by {max_diff(got['running_var'], ref['running_var']):.2e}: {hint}")


def check_backward(checks: Checks, got: dict, ref: dict, rank: int, world_size: int) -> None:
    expected = my_slice(ref["grad_input"], rank, world_size)
    checks.expect(close(got["grad_input"], expected),
                  f"the input gradient differs by {max_diff(got['grad_input'], expected):.2e}: if the output "
                  f"is right, is there an all_reduce missing in backward? sum(dy) and sum(dy * x_hat) must be "
                  f"summed over every rank and divided by the global count")
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
    check_forward(checks, got, ref, me.rank, me.world_size)
    check_backward(checks, got, ref, me.rank, me.world_size)


if __name__ == "__main__":
    run_lab(main, title="Lab 07 (syncbn)")
