"""Chapter 07: the mistakes its check must name."""

from mutation import Mutation, Variant

# global_channel_stats' body after `dims = reduce_dims(x)`, replaced whole by the variants below
STATS = ("    wide = x.double()  # float64 sums: sum_sq / count - mean**2 keeps the digits that float32 would lose\n"
         "    local_sum = wide.sum(dims)\n"
         "    local = torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (wide * wide).sum(dims)])\n"
         "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n"
         "    count, total, total_sq = local\n"
         "    mean = total / count\n"
         "    var = total_sq / count - mean * mean\n"
         "    count, mean, var = count.to(x.dtype), mean.to(x.dtype), var.to(x.dtype)\n")
GRAD_X = ("per_channel(sum_dy / count, grad_out) - x_hat * per_channel(sum_dy_xhat / count, grad_out)")
SAVE = ("        ctx.save_for_backward(x_hat, weight, invstd, count)\n"
        "        return x_hat * per_channel(weight, x) + per_channel(bias, x)\n")

MUTATIONS = [
    # REVIEW 6: right on gloo, wrong on a GPU: seen on the stand-in GPU (ringside.standin)
    Mutation("the count made on the CPU", "torch.full_like(local_sum, x.numel() // x.shape[1])",
             "torch.full(local_sum.shape, x.numel() // x.shape[1], dtype=torch.float64)",
             "global_channel_stats, run as on a GPU machine", 2),
    Mutation("biased running variance", "momentum * var * count / (count - 1))", "momentum * var)",
             "it matches the biased variance", 2),
    Mutation("running buffers rebound, not updated in place",
             "            running_mean.mul_(1 - momentum).add_(momentum * mean)\n"
             "            running_var.mul_(1 - momentum).add_(momentum * var * count / (count - 1))\n",
             "            running_mean = (1 - momentum) * running_mean + momentum * mean\n"
             "            running_var = (1 - momentum) * running_var + momentum * var * count / (count - 1)\n",
             "only rebinds a local name", 2),
    Mutation("momentum the wrong way round", "running_mean.mul_(1 - momentum).add_(momentum * mean)",
             "running_mean.mul_(momentum).add_((1 - momentum) * mean)", "momentum is the weight of the new value", 2),
    Mutation("normalized with the unbiased variance", "invstd = torch.rsqrt(var + eps)",
             "invstd = torch.rsqrt(var * count / (count - 1) + eps)", "normalized with the unbiased variance", 2),
    Mutation("eps outside the square root", "invstd = torch.rsqrt(var + eps)", "invstd = 1 / (var.sqrt() + eps)",
             "eps was added after the square root", 2),
    Mutation("no all_reduce in backward", "        dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)\n", "",
             "is there an all_reduce missing in backward?", 4),
    Mutation("AVG instead of SUM in backward", "dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)",
             "dist.all_reduce(local_sums, op=dist.ReduceOp.AVG)", "the sums were averaged over the ranks", 3),
    Mutation("backward divides by this rank's count", GRAD_X,
             GRAD_X.replace("/ count", "/ (grad_out.numel() // grad_out.shape[1])"),
             "divided by this rank's count", 3),
    Mutation("backward without the variance term", GRAD_X, "per_channel(sum_dy / count, grad_out)",
             "the term of the variance is missing", 2),
    Mutation("eps left out", "invstd = torch.rsqrt(var + eps)", "invstd = torch.rsqrt(var)",
             "eps was left out", 2),
    Mutation("backward without weight", "grad_x = per_channel(weight * invstd, grad_out)",
             "grad_x = per_channel(invstd, grad_out)", "the weight factor is missing", 2),
    Mutation("mean of means",
             "torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (wide * wide).sum(dims)])",
             "torch.stack([torch.ones_like(local_sum), wide.mean(dims), (wide * wide).mean(dims)])",
             "are you averaging means instead of weighting by count?", 4),
    Mutation("count not all-reduced",
             "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n    count, total, total_sq = local\n",
             "    dist.all_reduce(local[1:], op=dist.ReduceOp.SUM)\n    count, total, total_sq = local\n",
             "is the count all_reduced together with the sums", 2),
    Mutation("no all_reduce in forward", "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n", "",
             "are the statistics all_reduced?", 2),
    Mutation("all-reduced weight gradient", "grad_weight, grad_bias = local_sums[1].clone(), local_sums[0].clone()\n",
             "grad_weight, grad_bias = local_sums[1], local_sums[0]\n", "4x too large after summing over ranks", 4),
    Mutation("weight and bias gradients swapped", "grad_weight, grad_bias = local_sums[1].clone(), local_sums[0].clone()\n",
             "grad_weight, grad_bias = local_sums[0].clone(), local_sums[1].clone()\n",
             "grad_weight and grad_bias are swapped", 2),
    Mutation("count is the batch size, not the values per channel",
             "torch.full_like(local_sum, x.numel() // x.shape[1])", "torch.full_like(local_sum, x.shape[0])", "the number of images on all ranks", 4),
    Mutation("unbiased correction with this rank's count", "momentum * var * count / (count - 1))",
             "momentum * var * (x.numel() // x.shape[1]) / (x.numel() // x.shape[1] - 1))",
             "must use the global count", 3),
    Mutation("the output saved for backward instead of x_hat", SAVE,
             "        out = x_hat * per_channel(weight, x) + per_channel(bias, x)\n"
             "        ctx.save_for_backward(out, weight, invstd, count)\n        return out\n",
             "backward used the output y = x_hat * weight + bias where x_hat belongs", 4),
    Mutation("async all_reduce in backward never waited on", "dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)",
             "dist.all_reduce(local_sums, op=dist.ReduceOp.SUM, async_op=True)",
             "async_op=True in backward is never waited on", 4),
    Mutation("statistics all-reduced with AVG", "dist.all_reduce(local, op=dist.ReduceOp.SUM)",
             "dist.all_reduce(local, op=dist.ReduceOp.AVG)", "was it all_reduced with ReduceOp.AVG?", 3),
]

# Right code written otherwise: the check must pass it (found by trying it as a learner might).
CORRECT = [
    Variant("two passes: the global mean first, then the squared deviations from it",
            STATS,
            "    local = torch.stack([torch.full_like(x.sum(dims), x.numel() // x.shape[1]), x.sum(dims)])\n"
            "    dist.all_reduce(local)\n"
            "    count, total = local\n"
            "    mean = total / count\n"
            "    squares = ((x - mean.view([1, -1] + [1] * (x.dim() - 2))) ** 2).sum(dims)\n"
            "    dist.all_reduce(squares)\n"
            "    var = squares / count\n", 3),
]

MUTATIONS += [
    # Inputs the lab's own run never uses: (N, C, L) and (N, C), which the contract allows
    Mutation("statistics over dims (0, 2, 3) only", "    dims = reduce_dims(x)\n", "    dims = [0, 2, 3]\n",
             "on an input of shape (N, C, L) raised", 2),
    Mutation("backward's sums over dims (0, 2, 3) only", "        dims = reduce_dims(grad_out)\n",
             "        dims = [0, 2, 3]\n", "the statistics run over every dimension but the channels", 3),
    Mutation("normalized with 4-D views", "        x_hat = (x - per_channel(mean, x)) * per_channel(invstd, x)",
             "        x_hat = (x - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)",
             "reduce_dims(x) and per_channel(t, x)", 2),
]

NPROCS = (2, 3, 4)
REFUSES = (1,)  # at one rank code with no all_reduce at all gives the right answer

CORRECT += [
    # (n, mean, M2) of each rank all-gathered and combined pairwise (Chan et al.), float32 throughout
    Variant("per-rank (count, mean, M2) all-gathered and combined (Chan)", STATS,
            "    n = torch.full((x.shape[1],), float(x.numel() // x.shape[1]), dtype=x.dtype, device=x.device)\n"
            "    m = x.mean(dims) if x.numel() else torch.zeros_like(n)\n"
            "    m2 = ((x - per_channel(m, x)) ** 2).sum(dims)\n"
            "    everyone = [torch.empty_like(torch.stack([n, m, m2])) for _ in range(dist.get_world_size())]\n"
            "    dist.all_gather(everyone, torch.stack([n, m, m2]))\n"
            "    count, mean, M2 = everyone[0][0].clone(), everyone[0][1].clone(), everyone[0][2].clone()\n"
            "    for other in everyone[1:]:\n"
            "        nb, mb, m2b = other\n"
            "        total = count + nb\n"
            "        delta = mb - mean\n"
            "        mean = mean + delta * nb / total.clamp_min(1)\n"
            "        M2 = M2 + m2b + delta * delta * count * nb / total.clamp_min(1)\n"
            "        count = total\n"
            "    var = M2 / count\n", 4),
    # the backward as torch's source writes it: x and the mean saved, sum(dy) and sum(dy * (x - mean)) reduced
    Variant("backward from x - mean, as torch's source (sum_dy_xmu)",
            "        ctx.save_for_backward(x_hat, weight, invstd, count)\n        return x_hat * per_channel(weight, x) + per_channel(bias, x)\n        # END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad_out):\n        # HINT 1: every x moved the global mean and variance, so each input's gradient depends on two per-channel sums over the whole global batch: sum(dy) and sum(dy * x_hat)\n        # HINT 2: all_reduce (SUM) both sums in one tensor; grad_x = weight * invstd * (dy - sum_dy / count - x_hat * sum_dy_xhat / count); grad_weight = sum(dy * x_hat) and grad_bias = sum(dy) over this rank only\n        # BEGIN SOLUTION: return the gradients of x, weight and bias: the input gradient of normalizing over the global batch, and this rank's own weight and bias gradients (DDP averages those itself)\n        x_hat, weight, invstd, count = ctx.saved_tensors\n        dims = reduce_dims(grad_out)\n        local_sums = torch.stack([grad_out.sum(dims), (grad_out * x_hat).sum(dims)])\n        grad_weight, grad_bias = local_sums[1].clone(), local_sums[0].clone()\n        dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)\n        sum_dy, sum_dy_xhat = local_sums\n        grad_x = per_channel(weight * invstd, grad_out) * (\n            grad_out - per_channel(sum_dy / count, grad_out) - x_hat * per_channel(sum_dy_xhat / count, grad_out)\n        )\n",
            "        ctx.save_for_backward(x, weight, mean, invstd, count)\n        return x_hat * per_channel(weight, x) + per_channel(bias, x)\n        # END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad_out):\n        # HINT 1: every x moved the global mean and variance, so each input's gradient depends on two per-channel sums over the whole global batch: sum(dy) and sum(dy * x_hat)\n        # HINT 2: all_reduce (SUM) both sums in one tensor; grad_x = weight * invstd * (dy - sum_dy / count - x_hat * sum_dy_xhat / count); grad_weight = sum(dy * x_hat) and grad_bias = sum(dy) over this rank only\n        # BEGIN SOLUTION: return the gradients of x, weight and bias: the input gradient of normalizing over the global batch, and this rank's own weight and bias gradients (DDP averages those itself)\n        x, weight, mean, invstd, count = ctx.saved_tensors\n        dims = reduce_dims(grad_out)\n        xmu = x - per_channel(mean, x)\n        sum_dy, sum_dy_xmu = grad_out.sum(dims), (grad_out * xmu).sum(dims)\n        grad_weight, grad_bias = sum_dy_xmu * invstd, sum_dy.clone()\n        both = torch.cat([sum_dy, sum_dy_xmu])\n        dist.all_reduce(both)\n        sum_dy, sum_dy_xmu = both.split(len(sum_dy))\n        grad_x = per_channel(weight * invstd, grad_out) * (\n            grad_out - per_channel(sum_dy / count, grad_out)\n            - xmu * per_channel(invstd * invstd * sum_dy_xmu / count, grad_out))\n", 2),
    Variant("float64 sums of squares written otherwise, the variance clamped at 0", STATS, STATS.replace("(wide * wide).sum(dims)", "wide.pow(2).sum(dims)")
            .replace("var = total_sq / count - mean * mean", "var = torch.clamp(total_sq / count - mean ** 2, min=0)"), 3),
]

MUTATIONS += [
    # the between-rank term forgotten: the count-weighted mean of the ranks' own variances
    Mutation("pooled variance", STATS,
             "    n = x.numel() // x.shape[1]\n"
             "    local = torch.stack([torch.full_like(x.sum(dims), n), x.sum(dims), x.var(dims, unbiased=False) * n])\n"
             "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n"
             "    count, total, var_sum = local\n"
             "    mean = total / count\n"
             "    var = var_sum / count\n",
             "the count-weighted average of the ranks' own variances", 4),
    # right on full ranks; a rank with no sample makes x.mean() nan, and nan * 0 stays nan on every rank
    Mutation("each rank's mean and variance weighted by its count", STATS,
             "    n = x.numel() // x.shape[1]\n"
             "    m, v = x.mean(dims), x.var(dims, unbiased=False)\n"
             "    local = torch.stack([torch.full_like(m, n), m * n, (v + m * m) * n])\n"
             "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n"
             "    count, total, total_sq = local\n"
             "    mean = total / count\n"
             "    var = total_sq / count - mean * mean\n",
             "a mean or variance of an empty batch is 0 / 0 = nan", 2),
    Mutation("running_var updated with var + eps", "momentum * var * count / (count - 1))",
             "momentum * (var + eps) * count / (count - 1))", "eps belongs under the square root of the normalization only", 2),
    Mutation("only sum(dy) all-reduced in backward", "dist.all_reduce(local_sums, op=dist.ReduceOp.SUM)",
             "dist.all_reduce(local_sums[0], op=dist.ReduceOp.SUM)",
             "sum(dy) is summed over every rank but sum(dy * x_hat) is this rank's only", 4),
    Mutation("no communication at all", "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n    count, total, total_sq",
             "    count, total, total_sq", "are the statistics all_reduced?", 2),
    # the solution of round 3: sum_sq / count - mean**2 in float32 is 34% off at mean 1000, std 0.5
    Mutation("sums of squares in float32", "    wide = x.double()  # float64 sums", "    wide = x  # float32 sums",
             "the variance loses its digits where the mean is large against the spread", 2),
]
