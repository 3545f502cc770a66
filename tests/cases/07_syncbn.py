"""Chapter 07: the mistakes its check must name."""

from mutation import Mutation, Variant

GRAD_X = ("per_channel(sum_dy / count, grad_out) - x_hat * per_channel(sum_dy_xhat / count, grad_out)")
SAVE = ("        ctx.save_for_backward(x_hat, weight, invstd, count)\n"
        "        return x_hat * per_channel(weight, x) + per_channel(bias, x)\n")

MUTATIONS = [
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
             "torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (x * x).sum(dims)])",
             "torch.stack([torch.ones_like(local_sum), x.mean(dims), (x * x).mean(dims)])",
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
            "    local_sum = x.sum(dims)\n"
            "    local = torch.stack([torch.full_like(local_sum, x.numel() // x.shape[1]), local_sum, (x * x).sum(dims)])\n"
            "    dist.all_reduce(local, op=dist.ReduceOp.SUM)\n"
            "    count, total, total_sq = local\n"
            "    mean = total / count\n"
            "    var = total_sq / count - mean * mean\n",
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
