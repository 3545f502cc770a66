"""Chapter 14: the mistakes its check must name, in the fixed jobs and in the diagnoses."""

from mutation import Mutation, Variant

SLOW = True  # some of its mutated jobs wait out a 10 s collective timeout

MUTATIONS = [
    # REVIEW 6: right on gloo, wrong on a GPU: seen on the stand-in GPU (ringside.standin)
    Mutation("job 3's flag made on the CPU",
             "        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=me.device)\n",
             "        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])\n",
             "job3_fixed, run as on a GPU machine", 2),
    # job 1: the loop must end at the same step on every rank
    Mutation("job1 fix still stops on each rank's own loss",
             "        mean_loss = loss.detach().reshape(1)\n        dist.all_reduce(mean_loss)\n"
             "        if mean_loss.item() / me.world_size < TARGET_LOSS:\n",
             "        if loss.item() < TARGET_LOSS:\n",
             "a rank that leaves the loop alone leaves the others waiting", 2),  # a hang: 10 s
    Mutation("job1 fix keeps the loss all_reduce inside the rank-0 branch",
             "        dist.all_reduce(mean_loss)\n",
             "        if me.is_main:\n            dist.all_reduce(mean_loss)\n",
             "a branch that not every rank takes", 4),  # DETAIL: at once
    Mutation("job1 fix stops on the sum of the losses, not their mean",
             "        if mean_loss.item() / me.world_size < TARGET_LOSS:\n",
             "        if mean_loss.item() < TARGET_LOSS:\n",
             "the sum of the ranks' losses", 4),
    # job 2: unequal chunks, float64
    Mutation("job2 fix averages the ranks' means (unequal chunks)",
             "    totals = torch.stack([errors.double().sum(),\n"
             "                          torch.tensor(errors.numel(), dtype=torch.float64, device=errors.device)])\n"
             "    dist.all_reduce(totals)\n    return (totals[0] / totals[1]).item()\n",
             "    mean = errors.double().mean().reshape(1)\n    dist.all_reduce(mean)\n"
             "    return (mean / me.world_size).item()\n",
             "the mean of the ranks' means", 3),
    Mutation("job2 fix forgets to combine the ranks",
             "    dist.all_reduce(totals)\n", "",
             "this rank's own chunk only", 2),
    Mutation("job2 fix assumes equal chunks when counting",
             "torch.tensor(errors.numel(), dtype=torch.float64, device=errors.device)",
             "torch.tensor(N_VAL // me.world_size, dtype=torch.float64, device=errors.device)",
             "a wrong count", 4),
    Mutation("job2 fix adds up in float32",
             "    totals = torch.stack([errors.double().sum(),\n"
             "                          torch.tensor(errors.numel(), dtype=torch.float64, device=errors.device)])\n",
             "    totals = torch.stack([errors.sum(),\n"
             "                          torch.tensor(errors.numel(), dtype=torch.float32, device=errors.device)])\n",
             "add up the sums and counts in float64", 4),
    Mutation("job2 fix still gathers chunks of unequal sizes",
             "    totals = torch.stack([errors.double().sum(),\n"
             "                          torch.tensor(errors.numel(), dtype=torch.float64, device=errors.device)])\n"
             "    dist.all_reduce(totals)\n    return (totals[0] / totals[1]).item()\n",
             "    gathered = [torch.empty_like(errors) for _ in range(me.world_size)]\n"
             "    dist.all_gather(gathered, errors)\n    return torch.cat(gathered).mean().item()\n",
             "all_gather of chunks of unequal sizes", 2),  # DETAIL: at once
    # job 3: the skip must be collective
    Mutation("job3 fix skips the bad step on the bad rank alone",
             "        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=me.device)\n"
             "        dist.all_reduce(bad)\n        if bad.item() > 0:\n",
             "        if not torch.isfinite(loss):\n",
             "a rank that skips a step alone calls fewer collectives", 2),  # a hang: 10 s
    Mutation("job3 fix skips only when every rank's loss is bad",
             "        if bad.item() > 0:\n", "        if bad.item() == me.world_size:\n",
             "the weights hold NaN", 3),
    # the diagnoses
    Mutation("job1 diagnosis blames a waiting rank", '"rank": {2: 1, 3: 1, 4: 3}[world_size]', '"rank": 0',
             "diagnosis of job1: rank 0 is not the rank at fault", 2),
    Mutation("job1 diagnosis writes the rank of another world size", '"rank": {2: 1, 3: 1, 4: 3}[world_size]',
             '"rank": 1', "diagnosis of job1: rank 1 is not the rank at fault at 4 ranks", 4),
    Mutation("job2 diagnosis writes the last rank as a constant", '"rank": world_size - 1,', '"rank": 3,',
             "diagnosis of job2: rank 3 is not the rank at fault at 2 ranks", 2),
    Mutation("job1 diagnosis names the line where the other ranks waited",
             '"line": "if loss.item() < TARGET_LOSS:"', '"line": "average_gradients_and_step(w, loss, me)"',
             "is not where the rank at fault parts ways", 4),
    Mutation("job2 diagnosis names the line that makes the chunks",
             '"line": "dist.all_gather(gathered, errors)"',
             '"line": "x, y = x.chunk(me.world_size)[me.rank], y.chunk(me.world_size)[me.rank]"',
             "is not where the rank at fault parts ways", 2),
    Mutation("job3 diagnosis names a line of another function",
             """"line": 'raise FloatingPointError(f"the loss is {loss.item()} at sample {start} of my shard")'""",
             '"line": "dist.all_reduce(w.grad)"',
             "is not a line of job3_broken", 2),
    Mutation("job2 diagnosis gives no cause",
             '"cause": "1001 does not divide by the world size: the last chunk is shorter, and "\n'
             '                          "all_gather needs tensors of one shape on every rank"},',
             '"cause": ""},',
             "say in a sentence why it fails", 2),
]
NPROCS = (2, 3, 4)
REFUSES = (1, 5)  # one rank has no one to part ways with; diagnoses are written for 2-4

CORRECT = [
    Variant("job 1: the ranks' mean by ReduceOp.AVG",
            "        dist.all_reduce(mean_loss)\n        if mean_loss.item() / me.world_size < TARGET_LOSS:\n",
            "        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)\n        if mean_loss.item() < TARGET_LOSS:\n", 3),
    Variant("job 2: each rank's (sum, count) gathered as objects",
            "    totals = torch.stack([errors.double().sum(),\n"
            "                          torch.tensor(errors.numel(), dtype=torch.float64, device=errors.device)])\n"
            "    dist.all_reduce(totals)\n    return (totals[0] / totals[1]).item()\n",
            "    parts = [None] * dist.get_world_size()\n"
            "    dist.all_gather_object(parts, (errors.double().sum().item(), errors.numel()))\n"
            "    return sum(s for s, _ in parts) / sum(n for _, n in parts)\n", 3),
    Variant("job 3: every rank's 'finite' flag reduced with MIN",
            "        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=me.device)\n"
            "        dist.all_reduce(bad)\n        if bad.item() > 0:\n",
            "        finite = torch.isfinite(loss.detach()).to(torch.int32).reshape(1)\n"
            "        dist.all_reduce(finite, op=dist.ReduceOp.MIN)\n        if finite.item() == 0:\n", 3),
]

MUTATIONS += [
    # REVIEW B: an input never tried: a loss that is inf, not NaN
    Mutation("job3 fix tests the loss for NaN only", "0.0 if torch.isfinite(loss) else 1.0",
             "1.0 if torch.isnan(loss) else 0.0", "not torch.isnan", 2),
]
