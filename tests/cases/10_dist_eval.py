"""Chapter 10: the mistakes an exact distributed evaluation's check must name."""

import torch
from mutation import Mutation, Variant

MUTATIONS = [
    Mutation("padded duplicates counted", "            real = positions < n_samples\n",
             "            real = positions >= 0\n",
             "you counted the padded duplicates", 4),
    Mutation("positions without the running offset",
             "positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)",
             "positions = rank + world_size * torch.arange(len(y), device=device)",
             "the position of a sample continues across batches", 4),
    Mutation("positions without the rank",
             "positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)",
             "positions = world_size * torch.arange(seen, seen + len(y), device=device)",
             "you counted the padded duplicates", 4),  # k * world_size < n_samples always: the padding's effect
    Mutation("positions of contiguous shards",
             "positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)",
             "positions = rank * len(loader.sampler) + torch.arange(seen, seen + len(y), device=device)",
             "the positions assume contiguous shards", 4),
    Mutation("padding counted in the count only", "sums[1] += real.sum()", "sums[1] += len(y)",
             "the count includes the padding copies", 3),
    Mutation("no model.eval()", "    model.eval()\n", "", "call model.eval()", 2),
    Mutation("per-rank accuracies averaged",
             "    totals = sums.clone()\n    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n"
             "    correct, count, loss_sum = totals.tolist()\n    return correct / count, loss_sum / count\n",
             "    per_rank = torch.stack([sums[0] / sums[1], sums[2] / sums[1]])\n"
             "    dist.all_reduce(per_rank, op=dist.ReduceOp.AVG)\n    return tuple(per_rank.tolist())\n",
             "you averaged the per-rank accuracies", 4),
    Mutation("no all_reduce", "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n", "",
             "all_reduce the sums over all ranks", 2),
    Mutation("MAX instead of SUM", "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n",
             "    dist.all_reduce(totals, op=dist.ReduceOp.MAX)\n", "not MAX", 3),
    Mutation("all_reduce on the caller's tensor", "    totals = sums.clone()\n", "    totals = sums\n",
             "exact_metrics changed its argument `sums` in place", 2),
    Mutation("float32 sums", "sums = torch.zeros(3, dtype=torch.float64, device=device)",
             "sums = torch.zeros(3, device=device)", "return one float64 tensor", 2),
    Mutation("batch mean losses added up", "sums[2] += losses[real].double().sum()",
             "sums[2] += losses[real].double().mean()", "adding up batch means", 2),
    # Found by a learner trying mistakes of their own:
    Mutation("mask off by one", "            real = positions < n_samples\n",
             "            real = positions <= n_samples\n", "the mask must be positions < n_samples", 4),
    Mutation("mask left off correct", "sums[0] += (logits.argmax(dim=1) == y)[real].sum()",
             "sums[0] += (logits.argmax(dim=1) == y).sum()", "correct includes the padding copies", 4),
    Mutation("training mode restored after a batch-mean loss",  # model.train() after is fine: not blamed
             "            sums[2] += losses[real].double().sum()\n    return sums\n",
             "            sums[2] += losses[real].double().mean()\n    model.train()\n    return sums\n",
             "adding up batch means", 4),
    Mutation("float16 sums converted at the end",  # float32 ones stay within the tolerance: CORRECT
             "            sums[2] += losses[real].double().sum()\n    return sums\n",
             "            sums = sums.half()  # a float16 accumulator\n"
             "            sums[2] += losses[real].half().sum()\n    return sums.double()\n",
             "added up in float16", 4),
    Mutation("count of batches", "sums[1] += real.sum()", "sums[1] += 1", "the number of batches", 2),
    Mutation("all_reduce inside local_sums", "    return sums\n", "    dist.all_reduce(sums)\n    return sums\n",
             "returned the totals over all ranks", 2),
    Mutation("positions computed after the batch was counted (every sample shifted one batch on)",
             "            positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)\n"
             "            real = positions < n_samples\n            seen += len(y)\n",
             "            seen += len(y)\n"
             "            positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)\n"
             "            real = positions < n_samples\n",
             "no sample was counted as real on any rank", 3),
]

CORRECT = [  # a float32 loss sum of 1,001 losses is off by about 4e-8 relative, inside the check's 1e-6
    Variant("float32 sums converted at the end",
            "            sums[2] += losses[real].double().sum()\n    return sums\n",
            "            sums = sums.float()  # a float32 accumulator, as torch.zeros(3) makes\n"
            "            sums[2] += losses[real].sum()\n    return sums.double()\n", 4),
]

NPROCS = (2, 3, 4, 5)
REFUSES = (1,)  # at one rank the classic mistakes give the right answer
NODES = True  # rank-0 work

# The body of local_sums, replaced whole by the variants written otherwise below
BODY = (
    "    rank, world_size = dist.get_rank(), dist.get_world_size()\n"
    "    sums = torch.zeros(3, dtype=torch.float64, device=device)\n"
    "    seen = 0\n"
    "    model.eval()\n"
    "    with torch.no_grad():\n"
    "        for x, y in loader:\n"
    "            x, y = x.to(device), y.to(device)\n"
    "            logits = model(x)\n"
    "            positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)\n"
    "            real = positions < n_samples\n"
    "            seen += len(y)\n"
    "            losses = F.cross_entropy(logits, y, reduction=\"none\")\n"
    "            sums[0] += (logits.argmax(dim=1) == y)[real].sum()\n"
    "            sums[1] += real.sum()\n"
    "            sums[2] += losses[real].double().sum()\n"
    "    return sums\n")

CORRECT += [
    # count the real samples with range(), concatenate the outputs, slice once; inference_mode; the mode restored
    Variant("real samples counted with range(), outputs concatenated and sliced once", BODY,
            "    rank, world_size = dist.get_rank(), dist.get_world_size()\n"
            "    real = len(range(rank, n_samples, world_size))\n"
            "    was_training = model.training\n"
            "    model.eval()\n"
            "    with torch.inference_mode():\n"
            "        logits = torch.cat([model(x.to(device)) for x, _ in loader])[:real]\n"
            "        labels = torch.cat([y.to(device) for _, y in loader])[:real]\n"
            "    model.train(was_training)\n"
            "    correct = (logits.argmax(1) == labels).sum().item()\n"
            "    loss_sum = F.cross_entropy(logits.double(), labels, reduction=\"sum\").item()\n"
            "    return torch.tensor([correct, real, loss_sum], dtype=torch.float64, device=device)\n", 4),
    Variant("sums all-gathered, then added", "    totals = sums.clone()\n    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n"
            "    correct, count, loss_sum = totals.tolist()\n",
            "    everyone = [torch.empty_like(sums) for _ in range(dist.get_world_size())]\n"
            "    dist.all_gather(everyone, sums)\n"
            "    correct, count, loss_sum = torch.stack(everyone).sum(0).tolist()\n", 3),
    Variant("float32 accumulator from torch.zeros(3, device=device), float64 returned",
            "sums = torch.zeros(3, dtype=torch.float64, device=device)", "sums = torch.zeros(3, device=device)", 2),
]
CORRECT[-1] = CORRECT[-1]._replace(old=BODY, new=BODY.replace(
    "sums = torch.zeros(3, dtype=torch.float64, device=device)", "sums = torch.zeros(3, device=device)").replace(
    "    return sums\n", "    return sums.double()\n"))

MUTATIONS += [
    # duplicates looked for among this rank's own samples: the padding copies are of other ranks' samples
    Mutation("duplicates removed by sample identity within the rank", BODY,
             "    sums = torch.zeros(3, dtype=torch.float64, device=device)\n"
             "    seen = set()\n"
             "    model.eval()\n"
             "    with torch.no_grad():\n"
             "        for x, y in loader:\n"
             "            x, y = x.to(device), y.to(device)\n"
             "            logits = model(x)\n"
             "            keep = torch.tensor([not (tuple(r.tolist()) in seen or seen.add(tuple(r.tolist()))) for r in x])\n"
             "            losses = F.cross_entropy(logits, y, reduction=\"none\")\n"
             "            sums[0] += (logits.argmax(dim=1) == y)[keep].sum()\n"
             "            sums[1] += keep.sum()\n"
             "            sums[2] += losses[keep].double().sum()\n"
             "    return sums\n",
             "you counted the padded duplicates", 4),
]

if torch.cuda.is_available():  # on a CPU every tensor is on the data's device: the PASS says so in one line
    MUTATIONS.append(Mutation("sums made on the CPU (no device=)",
                              "sums = torch.zeros(3, dtype=torch.float64, device=device)",
                              "sums = torch.zeros(3, dtype=torch.float64)", "local_sums returned its sums on cpu", 2))

# Right on gloo, wrong on a GPU machine: seen when the check runs it again on a stand-in GPU
MUTATIONS += [
    Mutation("the sums made without device=", "    sums = torch.zeros(3, dtype=torch.float64, device=device)\n",
             "    sums = torch.zeros(3, dtype=torch.float64)\n",
             "is made by `sums = torch.zeros(3, dtype=torch.float64)`", 2),
]
