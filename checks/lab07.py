"""The check of lab 07 (syncbn): it runs the code of labs/07_syncbn.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder, lab_namespaces
from ringside.compare import max_diff
from ringside.effects import Inputs, never_waited, on_rank_gpu

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The self-check: compare with nn.BatchNorm2d on the whole global batch, in one process --------

# EPS far above BatchNorm's default 1e-5, so that a misplaced or missing eps shows
CHANNELS, SIZE, SEED, MOMENTUM, EPS = 3, 4, 7, 0.3, 0.1
# Relative tolerance: float32 sums taken in another order than BatchNorm's; measured about 1e-7 apart
# (1e-6 relative for weight gradients, sums of ~400 terms). Every classic mistake is off by 1e-3 or more.
TOL = 1e-5


def batch_sizes(world_size: int) -> list[int]:
    """Unequal per-rank batches (2, 5, 8, 11 on 4 ranks): a mean of means would be wrong."""
    return [2 + 3 * r for r in range(world_size)]


def draws(seed: int, n: int, shape: tuple, mean=0.0, std=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples x = mean + std * randn and the upstream gradient (loss = sum(output * probe)), from one
    seed: every rank makes the same."""
    g = torch.Generator().manual_seed(seed)
    return mean + std * torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return draws(SEED, sum(batch_sizes(world_size)), (CHANNELS, SIZE, SIZE), 2.0, 1.5)


def sliced(t: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return sliced(t, batch_sizes(world_size), rank)


def make_bn(cls: type[nn.BatchNorm2d], weight=(0.5, 1.5, -2.0), bias=(0.1, -0.2, 0.3), eps=EPS) -> nn.BatchNorm2d:
    bn = cls(len(weight), eps=eps, momentum=MOMENTUM)
    with torch.no_grad():  # weight and bias away from 1 and 0, so their mistakes show
        bn.weight.copy_(torch.tensor(weight))
        bn.bias.copy_(torch.tensor(bias))
    return bn


def through(bn: nn.Module, x: torch.Tensor, probe: torch.Tensor, device=None, watch=None) -> dict:
    """One training step of `bn` on x (loss = sum(output * probe)): output, input gradient, the weight
    and bias gradients (summed over ranks when device is given: what DDP averages) and the running
    statistics (num_batches_tracked is the given forward's, not the Function's, to count)."""
    watch = watch or SimpleNamespace()
    x = x.clone().to(device or x.device).requires_grad_(True)
    watch.phase = "forward"
    out = bn(x)
    watch.phase = "backward"
    (out * probe.to(x.device)).sum().backward()
    watch.phase = "the check"
    got = {"output": out.detach(), "grad_input": x.grad if x.grad is not None else torch.zeros_like(x)}
    if getattr(bn, "weight", None) is not None:
        grads = torch.stack([bn.weight.grad, bn.bias.grad]).detach()
        if device is not None:
            dist.all_reduce(grads)
        got["grad_weight"], got["grad_bias"] = grads[0], grads[1]
    got.update((name, b) for name, b in bn.named_buffers() if name != "num_batches_tracked")
    return {name: t.detach().cpu().clone() for name, t in got.items()}


def reference(world_size: int) -> dict[str, torch.Tensor]:
    """One process, nn.BatchNorm2d, the global batch: what every rank's part must equal."""
    return through(make_bn(nn.BatchNorm2d), *global_batch(world_size))


@contextmanager
def watching():
    """Inside, the one recorder (ringside.calls) notes every collective with the phase it was made in
    (forward, backward, ...) and whether it completed, however the learner waited. On leaving, the
    check waits on what the learner left pending, so no collective stays in flight."""
    watch = SimpleNamespace(phase="")
    with Recorder(namespaces=lab_namespaces(lab), on_call=lambda call: call.update(phase=watch.phase)) as recorder:
        watch.recorder = recorder
        yield watch
    for call in never_waited(recorder.calls):  # not after an error: its report comes first
        if call.get("work") is not None:
            call["work"].wait()


def unwaited(watch) -> list[str]:
    phases = {call["phase"] for call in never_waited(watch.recorder.of("all_reduce"))}
    if "global_channel_stats" in phases:  # called from forward: forward's own finding is the same one
        phases.discard("forward")
    return sorted(phases)


def mine(rank: int, world_size: int, device: torch.device, watch) -> dict[str, torch.Tensor]:
    """This rank's slice through HandSyncBatchNorm2d; weight/bias gradients summed over ranks."""
    x, probe = global_batch(world_size)
    bn = make_bn(lab.HandSyncBatchNorm2d).to(device)
    return through(bn, my_slice(x, rank, world_size), my_slice(probe, rank, world_size), device, watch)


def probe_stats(rank: int, world_size: int, device: torch.device, watch):
    """global_channel_stats alone on this rank's slice: every rank calls it, whatever it finds later."""
    watch.phase = "global_channel_stats"
    x = Inputs(x=my_slice(global_batch(world_size)[0], rank, world_size).to(device))
    return lab.global_channel_stats(x.arguments["x"]), not x.changed()


def stats_finding(result, rank: int, world_size: int) -> str | None:
    """What is wrong with (count, mean, var) from global_channel_stats on this rank's slice; None if right."""
    x, _ = global_batch(world_size)
    part = my_slice(x, rank, world_size)
    sizes, pixels = batch_sizes(world_size), SIZE * SIZE
    n, n_mine = sum(sizes) * pixels, sizes[rank] * pixels
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    try:  # count may be one number or one per channel
        count, got_mean, got_var = (torch.as_tensor(t).detach().float().cpu().expand(CHANNELS) for t in result)
    except (TypeError, ValueError, RuntimeError):
        return ("it must return (count, mean, var): count one number or one per channel, mean and var of shape "
                f"(C,) = ({CHANNELS},)")
    if not all(torch.isfinite(t).all() for t in (count, got_mean, got_var)):
        return f"it returns NaN or inf (count {count.tolist()}) - a division by a zero count?"

    def near(t, value) -> bool:
        return close(t, torch.as_tensor(value, dtype=torch.float32).expand(CHANNELS))

    said = (f"count {count[0].item():g}, mean off by {max_diff(got_mean, mean):.2e}, "
            f"var off by {max_diff(got_var, var):.2e}")
    if near(count, n) and near(got_mean, mean) and near(got_var, var):
        return None  # right (at 1 rank a rank's own statistics are the global ones: no mistake to name)
    if near(got_mean, part.mean((0, 2, 3))) and near(got_var, part.var((0, 2, 3), unbiased=False)):
        return f"{said}: they are this rank's own statistics - are the statistics all_reduced?"
    if near(got_mean, mean_of_means(world_size)):
        return (f"{said}: the mean is the average of the ranks' means, but the batches have unequal sizes "
                f"{sizes} - are you averaging means instead of weighting by count? {WEIGHT_BY_COUNT}")
    if not near(count, n):  # which wrong count it is (a wrong one can equal the right one elsewhere)
        if near(count, n / world_size) and near(got_mean, mean):
            return (f"{said}: count is the average of the ranks' counts ({n / world_size:g}), not their sum {n} - "
                    "was it all_reduced with ReduceOp.AVG? all_reduce the count and the sums with SUM")
        if near(count, sum(sizes)):
            return (f"{said}: count is {sum(sizes)}, the number of images on all ranks, but each channel has "
                    f"images x pixels = {sum(sizes)} x {pixels} = {n} values (the statistics run over the pixels "
                    f"too, so the mean comes out {pixels}x too large) - count the values of a channel "
                    "(x.numel() // channels), not the batch size")
        if near(count, n * CHANNELS) or near(count, n_mine * CHANNELS):
            return (f"{said}: count is all channels' values together (x.numel()), but each channel has its own "
                    f"count: x.numel() // channels ({n} over all ranks)")
        if near(count, n_mine):
            return (f"{said}: count is this rank's {n_mine} values, not the {n} of all ranks - is the count "
                    "all_reduced together with the sums?")
        if near(count, sizes[rank]):
            return (f"{said}: count is this rank's batch size {sizes[rank]} - count the values of a channel on all "
                    f"ranks (images x pixels = {n}): x.numel() // channels, all_reduced with the sums")
        return (f"{said}: count must be {n}, the values of a channel on all ranks "
                f"({sum(sizes)} images x {pixels} pixels)")
    if not near(got_mean, mean):
        return f"{said}: the count is right but not the mean - mean = (sum over all ranks) / count"
    if near(got_var, var * n / (n - 1)):
        return (f"{said}: var is the unbiased variance - return the biased one (sum_sq / count - mean**2); "
                "only running_var stores the unbiased one")
    if near(got_var, var + mean * mean):
        return f"{said}: var is the mean of the squares - subtract mean**2 (var = sum_sq / count - mean**2)"
    if near(got_var, var.sqrt()):
        return f"{said}: that is the standard deviation - return the variance"
    if near(got_var, pooled_variance(world_size)):
        return (f"{said}: var is the count-weighted average of the ranks' own variances, which leaves out how far "
                f"each rank's mean lies from the global mean - the global batch's variance is around the global "
                f"mean, over every value of the channel")
    if not near(got_var, var):
        worst = int((got_var - var).abs().argmax())
        return (f"{said}: var differs from the biased variance of the global batch (channel {worst}: "
                f"{got_var[worst].item():.5f}, the global batch's {var[worst].item():.5f}), and it is none of the "
                f"known mistakes (the unbiased variance, the mean of squares, the standard deviation, the ranks' "
                f"variances averaged)")
    return None


def pooled_variance(world_size: int) -> torch.Tensor:
    """A classic wrong global variance: the ranks' own variances, weighted by their counts."""
    x, _ = global_batch(world_size)
    sizes = batch_sizes(world_size)
    parts = [my_slice(x, r, world_size) for r in range(world_size)]
    return sum(p.var((0, 2, 3), unbiased=False) * n for p, n in zip(parts, sizes)) / sum(sizes)


def mean_of_means(world_size: int) -> torch.Tensor:
    """The classic wrong global mean: every rank's own mean, averaged, whatever its batch size."""
    x, _ = global_batch(world_size)
    return torch.stack([my_slice(x, r, world_size).mean((0, 2, 3)) for r in range(world_size)]).mean(0)


def size(t: torch.Tensor) -> float:
    """The largest magnitude in t (0 for an empty tensor: a rank with no sample)."""
    return t.abs().max().item() if t.numel() else 0.0


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to TOL relative to the size of b (gradients of weight and bias are sums of ~400 terms)."""
    return max_diff(a, b) <= TOL * (1 + size(b))


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
        per_channel = lab.per_channel
        x_hat = (part - per_channel(m, part)) * per_channel(inv, part)
        return x_hat * per_channel(weight, part) + per_channel(bias, part)

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
        "no affine": (out(mean, torch.rsqrt(var + EPS)) / lab.per_channel(weight, part)
                      - lab.per_channel(bias / weight, part),
                      "the output is x_hat without weight and bias - return x_hat * weight + bias"),
    }


# The advice after averaging means: weight by count, and in float64 (a float32 sum of squares then
# Q/n - mean^2 cancels to nothing on a channel with a large mean and a small spread: the next run's failure).
WEIGHT_BY_COUNT = ("all_reduce the count, the sum and the sum of squares, summed in float64 (in float32, Q/n - mean^2 "
                   "cancels on a channel with a large mean and a small spread) - or all_gather each rank's count, "
                   "mean and variance and combine them weighted by count")

MOMENTUM_SWAPPED = ("momentum is the weight of the new value: running = (1 - momentum) * running + "
                    "momentum * batch statistic (PyTorch's convention, the opposite of an optimizer's)")


def expect_buffer(checks: Checks, name: str, got: dict, ref: dict, hint: str) -> None:
    """running_mean or running_var as BatchNorm on the global batch leaves it, else `hint`."""
    checks.expect(close(got[name], ref[name]), f"{name} differs by {max_diff(got[name], ref[name]):.2e}: {hint}")


def check_forward(checks: Checks, got: dict, ref: dict, rank: int, world_size: int) -> None:
    expected = my_slice(ref["output"], rank, world_size)
    if close(got["running_mean"], MOMENTUM * mean_of_means(world_size)):
        hint = ("the mean is the average of the ranks' means, but the batches have unequal sizes "
                f"{batch_sizes(world_size)} - are you averaging means instead of weighting by count? "
                + WEIGHT_BY_COUNT)
    else:
        hint = next((h for t, h in forward_variants(rank, world_size).values() if close(got["output"], t)),
                    "global_channel_stats is right, so the normalization with them is not BatchNorm's: none of the "
                    "known mistakes (the unbiased variance, eps outside the square root or left out, weight and bias "
                    "left out) fits")
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
        hint = MOMENTUM_SWAPPED
    else:
        hint = "it is not the momentum the wrong way round; the output is right, so look at how the buffer is updated"
    expect_buffer(checks, "running_mean", got, ref, hint)
    n = sum(batch_sizes(world_size)) * SIZE * SIZE
    start = 1 - MOMENTUM  # what is left of the initial running_var of 1 after one step
    unbiased = (ref["running_var"] - start) / MOMENTUM
    biased = start + (ref["running_var"] - start) * (n - 1) / n
    images = sum(batch_sizes(world_size))
    own_counts = (batch_sizes(world_size)[rank] * SIZE * SIZE, batch_sizes(world_size)[rank])
    if close(got["running_var"], biased):
        hint = ("it matches the biased variance - BatchNorm stores the unbiased one in running_var: "
                "multiply the variance by count / (count - 1) first")
    elif any(close(got["running_var"], start + (biased - start) * c / (c - 1)) for c in own_counts):
        hint = (f"the unbiased correction count / (count - 1) used this rank's count, not the global one ({n}) - "
                "the unbiased correction must use the global count (all ranks' values, the all_reduced one)")
    elif close(got["running_var"], start + (biased - start) * images / (images - 1)):
        hint = (f"the unbiased correction count / (count - 1) used the number of images ({images}), not of values "
                f"({n} = images x pixels) - use the global count of values per channel")
    elif close(got["running_var"], MOMENTUM + (1 - MOMENTUM) * unbiased):
        hint = MOMENTUM_SWAPPED
    elif close(got["running_var"], start + MOMENTUM * (unbiased + EPS * n / (n - 1))) or \
            close(got["running_var"], start + MOMENTUM * (unbiased + EPS)):
        hint = (f"it is {EPS:g} (eps) too large after the update: eps belongs under the square root of the "
                f"normalization only - nn.BatchNorm2d stores the variance itself")
    else:
        hint = ("it is none of the known mistakes (the biased variance stored, the momentum the wrong way round, "
                "a count of this rank's or of images in the unbiased correction, eps added)")
    expect_buffer(checks, "running_var", got, ref, hint)


def stand_ins_for_x_hat(world_size: int) -> list[tuple[torch.Tensor, str]]:
    """What a backward may have saved in place of x_hat (over the global batch), each with its hint."""
    x, _ = global_batch(world_size)
    bn = make_bn(nn.BatchNorm2d)
    weight, bias = bn.weight.detach(), bn.bias.detach()
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    centred = x - lab.per_channel(mean, x)
    x_hat = centred * lab.per_channel(torch.rsqrt(var + EPS), x)
    return [
        (x_hat * lab.per_channel(weight, x) + lab.per_channel(bias, x),
         "backward used the output y = x_hat * weight + bias where x_hat belongs - save x_hat (the normalized "
         "input, before weight and bias) for backward, not the returned output"),
        (x, "backward used the input x where x_hat belongs - save x_hat = (x - mean) / sqrt(var + eps) for backward"),
        (centred, "backward used x - mean where x_hat belongs - x_hat is (x - mean) / sqrt(var + eps): save that"),
    ]


def grad_input_variants(rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, str]]:
    """This rank's input gradient as the classic backward mistakes compute it, each with its hint."""
    x, dy_all = global_batch(world_size)
    weight = make_bn(nn.BatchNorm2d).weight.detach()
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    invstd = torch.rsqrt(var + EPS)
    x_hat_all = (x - lab.per_channel(mean, x)) * lab.per_channel(invstd, x)
    x_hat, dy = my_slice(x_hat_all, rank, world_size), my_slice(dy_all, rank, world_size)
    big, mine = x.numel() // CHANNELS, dy.numel() // CHANNELS
    dims = (0, 2, 3)
    total_dy, total_dyx = dy_all.sum(dims), (dy_all * x_hat_all).sum(dims)
    own_dy, own_dyx = dy.sum(dims), (dy * x_hat).sum(dims)

    def grad(sum_dy, sum_dyx, count, scale=weight * invstd, mean_term=True, xhat_term=True):
        g = dy.clone()
        if mean_term:
            g = g - lab.per_channel(sum_dy / count, dy)
        if xhat_term:
            g = g - x_hat * lab.per_channel(sum_dyx / count, dy)
        return lab.per_channel(scale, dy) * g

    missing = ("sum(dy) and sum(dy * x_hat) are this rank's only - is there an all_reduce missing in backward? "
               "(or an all_reduce with async_op=True whose result is read before .wait()) Both must be summed over "
               "every rank and divided by the global count")
    stand_ins = {}
    for z_all, hint in stand_ins_for_x_hat(world_size):
        z = my_slice(z_all, rank, world_size)
        per_channel = lab.per_channel
        stand_ins[hint] = (per_channel(weight * invstd, dy) * (dy - per_channel(total_dy / big, dy)
                                                               - z * per_channel((dy_all * z_all).sum(dims) / big, dy)),
                           hint)
    return {
        **stand_ins,
        "local sums": (grad(own_dy, own_dyx, big), missing),
        "local sums, local count": (grad(own_dy, own_dyx, mine), missing),
        "only sum(dy) reduced": (grad(total_dy, own_dyx, big),
                                 "sum(dy) is summed over every rank but sum(dy * x_hat) is this rank's only - both "
                                 "per-channel sums need the all_reduce"),
        "only sum(dy * x_hat) reduced": (grad(own_dy, total_dyx, big),
                                         "sum(dy * x_hat) is summed over every rank but sum(dy) is this rank's only - "
                                         "both per-channel sums need the all_reduce"),
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


def input_gradient_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """Where an input gradient that fits no known mistake differs, without the formula (deriving it is
    the lab's backward; `make hint CH=07` has it)."""
    per_channel_diff = (got - expected).abs().amax(dim=[d for d in range(got.dim()) if d != 1])
    channels = [c for c in range(len(per_channel_diff)) if per_channel_diff[c] > TOL * (1 + size(expected))]
    return (f"it fits none of the known mistakes; it differs in channel(s) {channels} - compare your backward with "
            f"autograd through BatchNorm on the global batch in one process, term by term (the sums over all ranks, "
            f"the count they are divided by, the factor in front); `make hint CH=07` gives the formula")


def check_backward(checks: Checks, got: dict, ref: dict, rank: int, world_size: int) -> None:
    expected = my_slice(ref["grad_input"], rank, world_size)
    if not close(got["output"], my_slice(ref["output"], rank, world_size)):
        hint = "the output is wrong too: fix the forward first"
    else:
        hint = next((h for t, h in grad_input_variants(rank, world_size).values() if close(got["grad_input"], t)),
                    input_gradient_difference(got["grad_input"], expected))
    checks.expect(close(got["grad_input"], expected),
                  f"the input gradient differs by {max_diff(got['grad_input'], expected):.2e}: {hint}")
    if close(got["grad_weight"], ref["grad_bias"]) and close(got["grad_bias"], ref["grad_weight"]):
        checks.fail("grad_weight and grad_bias are swapped: grad_weight = sum(dy * x_hat), grad_bias = sum(dy)")
        return
    for name in ("grad_weight", "grad_bias"):
        _, dy = global_batch(world_size)
        stand_in = [hint for z, hint in stand_ins_for_x_hat(world_size) if name == "grad_weight"
                    and close(got[name], (dy * z).sum((0, 2, 3)))]
        if close(got[name], world_size * ref[name]):
            hint = (f"it is {world_size}x too large after summing over ranks - return this rank's own "
                    f"sum, not the all_reduced one (DDP averages parameter gradients itself)")
        elif stand_in:
            hint = stand_in[0]
        else:
            hint = "grad_weight = sum(dy * x_hat), grad_bias = sum(dy), over this rank's values"
        checks.expect(close(got[name], ref[name]), f"{name} (summed over ranks) differs from BatchNorm's by "
                                                   f"{max_diff(got[name], ref[name]):.2e}: {hint}")


def check_other_shapes(checks: Checks, rank: int, world_size: int, device: torch.device) -> None:
    """x may be (N, C, ...): a sequence (N, C, L) and plain features (N, C), as BatchNorm1d takes them,
    must be normalized over the global batch too. The lab's own (N, C, H, W) cannot tell code that sums
    over dims (0, 2, 3) from code that sums over every dimension but the channels."""
    shown = {"output": "output", "grad_input": "the input gradient", "running_mean": "running_mean",
             "running_var": "running_var"}
    for tail, label in (((5,), "(N, C, L)"), ((), "(N, C)")):
        x, probe = draws(SEED + len(tail), sum(batch_sizes(world_size)), (CHANNELS, *tail), 2.0, 1.5)
        ref = through(make_bn(nn.BatchNorm1d), x, probe)
        try:  # every rank has the same shapes: they fail alike, at the same call
            got = through(make_bn(lab.HandSyncBatchNorm2d).to(device), my_slice(x, rank, world_size),
                          my_slice(probe, rank, world_size), device)
        except Exception as error:
            checks.fail(f"HandSyncBatchNorm2d on an input of shape {label} raised {type(error).__name__}: "
                        f"{str(error).splitlines()[0][:120]} - the statistics run over every dimension but the "
                        f"channels (dim 1), however many there are: reduce_dims(x) and per_channel(t, x) do that")
            return
        wrong = [said for name, said in shown.items() if not close(got[name], my_slice(ref[name], rank, world_size)
                                                                   if name in ("output", "grad_input") else ref[name])]
        if wrong:
            checks.fail(f"on an input of shape {label} (the lab's own is (N, C, H, W)) {', '.join(wrong)} differ from "
                        f"BatchNorm1d's on the global batch: the statistics run over every dimension but the "
                        f"channels, however many there are - reduce_dims(x) and per_channel(t, x), not (0, 2, 3)")
            return
    checks.expect(True, "")


# --- Inputs beyond the lab's own run: a rank with nothing, a hard channel, float64 ------------------

# A channel whose mean is large against its spread: in float32, sum_sq / count - mean**2 loses the digits
# of a variance of 0.25 (34% off); float64 sums, two passes or centred statistics combined stay far
# within HARD_TOL. The reference is BatchNorm on the global batch in float64. HARD_TOL, relative to
# 1 + the size of the reference: float32 rounding of a mean near 1000 moves x - mean by about 1e-4.
HARD_MEAN, HARD_STD, HARD_EPS, HARD_TOL = 1000.0, 0.5, 1e-5, 1e-3
HARD_BN = dict(weight=(0.5, -1.5), bias=(0.1, 0.2), eps=HARD_EPS)


def empty_rank_sizes(world_size: int) -> list[int]:
    """Rank 0 holds no sample; the others unequal batches."""
    return [0] + [1 + r for r in range(1, world_size)]


def hard_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel 0: mean 1000, std 0.5; channel 1: an ordinary one (mean -3, std 2). float32, 3x3 pixels."""
    return draws(SEED + 100, sum(empty_rank_sizes(world_size)), (2, 3, 3),
                 torch.tensor([HARD_MEAN, -3.0]).view(1, 2, 1, 1), torch.tensor([HARD_STD, 2.0]).view(1, 2, 1, 1))


def run_hard(rank: int, world_size: int, device: torch.device, watch) -> dict:
    """The learner's layer and global_channel_stats on a rank with nothing and a hard channel."""
    x, probe = hard_batch(world_size)
    sizes = empty_rank_sizes(world_size)
    bn = make_bn(lab.HandSyncBatchNorm2d, **HARD_BN).to(device)
    got = through(bn, sliced(x, sizes, rank), sliced(probe, sizes, rank), device, watch)
    watch.phase = "global_channel_stats"
    stats = lab.global_channel_stats(sliced(x, sizes, rank).to(device))
    got["mean"], got["var"] = (torch.as_tensor(t).detach().cpu().reshape(-1).expand(2) for t in stats[1:])
    return got


def hard_reference(world_size: int, rank: int) -> dict:
    x, probe = hard_batch(world_size)
    sizes = empty_rank_sizes(world_size)
    ref = through(make_bn(nn.BatchNorm2d, **HARD_BN).double(), x.double(), probe.double())
    ref.update(output=sliced(ref["output"], sizes, rank), grad_input=sliced(ref["grad_input"], sizes, rank),
               mean=x.double().mean((0, 2, 3)), var=x.double().var((0, 2, 3), unbiased=False))
    return {name: t.float() for name, t in ref.items()}


# Beyond float32: the layer as .double() on float64 input gives float64 results, as nn.BatchNorm2d does. (Its other
# options, momentum=None, affine=False and track_running_stats=False, are the given forward's to hand over: the
# solution's is tested against nn.BatchNorm2d in tests/test_syncbn_options.py, not the learner's code here.)
FLOAT64 = f"HandSyncBatchNorm2d({CHANNELS}).to(torch.float64) on float64 input"


def run_float64(bn: nn.Module, rank: int, world_size: int, device=None, watch=None) -> dict:
    """Two training steps of `bn` in float64, then one in evaluation mode: on this rank's part when
    `device` is given (the learner's layer), else on the global batch, cut to this rank's part."""
    def part(t):
        return sliced(t, batch_sizes(world_size), rank)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = sum(batch_sizes(world_size))
        return tuple(t.double() for t in draws(SEED + 200 + step, n, (CHANNELS, 2, 2), 1.0, 2.0))

    got = {}
    for step in range(2):
        x, probe = batch(step)
        whole = through(bn, x, probe) if device is None else through(bn, part(x), part(probe), device, watch)
        got.update((f"{name}, step {step + 1}", part(t) if device is None and name in ("output", "grad_input") else t)
                   for name, t in whole.items())
    bn.eval()
    x = batch(2)[0]
    with torch.no_grad():  # evaluation: the running statistics, elementwise (the whole batch cut = the part)
        got["output in eval mode"] = part(bn(x)) if device is None else bn(part(x).to(device)).cpu()
    return got


def check_float64(checks: Checks, got, rank: int, world_size: int) -> None:
    """In float64, the layer gives what nn.BatchNorm2d gives on the global batch."""
    if isinstance(got, Exception):
        checks.fail(f"{FLOAT64} raised {type(got).__name__}: {str(got).splitlines()[0][:120] if str(got) else ''} "
                    f"- nn.BatchNorm2d takes this option (its forward hands your Function what it expects)")
        return
    ref = run_float64(nn.BatchNorm2d(CHANNELS, eps=EPS, momentum=MOMENTUM).double(), rank, world_size)
    missing = sorted(set(ref) - set(got))
    wrong = [name for name in ref if name in got and (got[name].dtype != ref[name].dtype
                                                      or not close(got[name].float(), ref[name].float()))]
    if missing or wrong:
        first = (missing or wrong)[0]
        said = "is missing" if first in missing else (
            f"has dtype {got[first].dtype}, nn.BatchNorm2d's {ref[first].dtype}" if got[first].dtype != ref[first].dtype
            else f"differs by {max_diff(got[first].float(), ref[first].float()):.2e}")
        checks.fail(f"{FLOAT64}: {first} {said} from nn.BatchNorm2d on the global batch"
                    + (f" (also: {', '.join((missing + wrong)[1:4])})" if len(missing + wrong) > 1 else ""))
    else:
        checks.expect(True, "")


def check_hard(checks: Checks, got, everyone_nan: bool, rank: int, world_size: int) -> None:
    """A rank with nothing, and a channel with mean 1000 and std 0.5, against BatchNorm in float64."""
    sizes = empty_rank_sizes(world_size)
    where = (f"with batches {sizes} on {world_size} ranks (rank 0 holds none) and channel 0 at mean "
             f"{HARD_MEAN:g}, std {HARD_STD:g} (float32)")
    if isinstance(got, Exception):
        checks.fail(f"{where}, your layer raised {type(got).__name__}: {str(got).splitlines()[0][:120]} - "
                    f"nn.SyncBatchNorm takes a rank with no sample: it adds nothing to the sums")
        return
    ref = hard_reference(world_size, rank)
    nan = [name for name, t in got.items() if not torch.isfinite(t).all()]
    if nan:
        cause = (" on every rank: a mean or variance of an empty batch is 0 / 0 = nan, and weighting it by its count "
                 "of 0 leaves nan - exchange quantities that are 0 for an empty batch" if everyone_nan else "")
        checks.fail(f"{where}, {', '.join(nan)} hold NaN{cause}; nn.SyncBatchNorm gives rank 0 an empty output and "
                    f"every rank the global batch's statistics")
        return

    def near(name: str) -> bool:
        return max_diff(got[name], ref[name]) <= HARD_TOL * (1 + size(ref[name]))

    wrong = [name for name in ref if got[name].shape != ref[name].shape or not near(name)]
    if not wrong:
        checks.expect(True, "")
        return
    var_off = [c for c in range(2) if abs(got["var"][c] - ref["var"][c]) > HARD_TOL * (1 + ref["var"][c].abs())]
    if var_off == [0] and near("mean"):
        checks.fail(f"{where}: global_channel_stats' var of channel 0 is {got['var'][0].item():.4f}, the global "
                    f"batch's {ref['var'][0].item():.4f} (tolerance {HARD_TOL:g} relative), channel 1 is right: "
                    f"the variance loses its digits where the mean is large against the spread - in float32 a "
                    f"difference of two numbers near {HARD_MEAN ** 2:g} cannot hold a variance of "
                    f"{HARD_STD ** 2:g}; nn.SyncBatchNorm avoids that (chapter 07, the note on precision)")
        return
    first = wrong[0]
    checks.fail(f"{where}: {first} differs from BatchNorm's on the global batch by "
                f"{max_diff(got[first], ref[first]) if got[first].shape == ref[first].shape else float('inf'):.2e} "
                f"(tolerance {HARD_TOL:g} relative)" + (f"; so do {', '.join(wrong[1:4])}" if len(wrong) > 1 else ""))


def one_rank_proves_nothing(world_size: int) -> str | None:
    """At one rank this rank's statistics are the global batch's: no communication is needed."""
    if world_size == 1:
        return ("on one rank a rank's statistics are the global batch's, so code with no all_reduce at all (or "
                "one that forgets the backward's) gives the right answer and a PASS would prove nothing: use "
                "--nproc-per-node 2 or more")
    return None


def main(me: Rank, checks: Checks) -> None:
    with watching() as watch:  # every rank makes the same collective calls, before any verdict
        got = mine(me.rank, me.world_size, me.device, watch)
        stats = probe_stats(me.rank, me.world_size, me.device, watch)
        try:
            hard = run_hard(me.rank, me.world_size, me.device, watch)
        except Exception as error:  # judged below, after the lab's own case
            hard = error
        try:
            float64 = lab.HandSyncBatchNorm2d(CHANNELS, eps=EPS, momentum=MOMENTUM).to(me.device, torch.float64)
            float64 = run_float64(float64, me.rank, me.world_size, me.device, watch)
        except Exception as error:  # the same on every rank: same shapes
            float64 = error
    nan_here = torch.tensor([float(isinstance(hard, dict) and bool(not_finite(hard)))], device=me.device)
    dist.all_reduce(nan_here, op=dist.ReduceOp.MIN)  # 1 when every rank holds NaN
    ref = reference(me.world_size)
    print0(f"per-rank batch sizes {batch_sizes(me.world_size)}, {CHANNELS} channels of {SIZE}x{SIZE}")
    if unwaited(watch):  # its values depend on timing: no comparison can say more
        checks.fail(f"an all_reduce with async_op=True in {' and '.join(unwaited(watch))} is never waited on: "
                    "its result may not have arrived when you read it (ranks would see different values) - call "
                    ".wait() on the handle it returns before using the tensor, or leave async_op out")
        return
    stats, input_kept = stats
    if not checks.expect(input_kept, "global_channel_stats changed its input x in place (an in-place subtraction or "
                                     "square?): the layer normalizes that same x afterwards - compute on new tensors"):
        return
    finding = stats_finding(stats, me.rank, me.world_size)
    if not checks.expect(finding is None, "global_channel_stats on this rank's slice differs from the global "
                                          f"batch's statistics: {finding}"):
        return  # everything downstream depends on the statistics: name them first
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
        checks.fail(f"{', '.join(broken)} hold NaN or inf, though global_channel_stats is right: a square root "
                    f"of a negative number or a division by zero in forward or backward - is eps added to the "
                    f"biased variance under the square root, and the count (not count - 1 of a count of 1) used?")
        return
    check_forward(checks, got, ref, me.rank, me.world_size)
    check_backward(checks, got, ref, me.rank, me.world_size)
    if checks.failures:
        return  # the lab's own case first: the cases below would only repeat it
    check_hard(checks, hard, bool(nan_here.item()), me.rank, me.world_size)
    check_float64(checks, float64, me.rank, me.world_size)
    if not checks.failures:  # the same on every rank: each makes the same collectives
        check_other_shapes(checks, me.rank, me.world_size, me.device)
    if not checks.failures:
        check_on_gpu(checks, me)


def check_on_gpu(checks: Checks, me: Rank) -> bool:
    """global_channel_stats run again as on a GPU machine (ringside.effects.on_rank_gpu), x on this rank's
    stand-in GPU: what it all-reduces and returns stays there. (SyncBatchNormFunction is an autograd
    Function, which the stand-in does not record: its device is not checked here.)"""
    x = torch.arange(2 * CHANNELS * 9, dtype=torch.float32).reshape(2, CHANNELS, 3, 3) + me.rank
    problem, note = on_rank_gpu("global_channel_stats", lambda device: lab.global_channel_stats(x.to(device)),
                                lab.global_channel_stats)
    ok = checks.agree(problem)
    if ok or note:
        print0(note or "global_channel_stats, run as on a GPU machine: its tensors stay on the GPU (the autograd "
                       "Function's own tensors are not checked there)")
    return ok


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 07 (syncbn)", refuse=one_rank_proves_nothing)
