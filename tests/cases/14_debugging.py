"""Chapter 14: the mistakes its check must name, in the fixed jobs and in the diagnoses."""

from mutation import Mutation

SLOW = True  # its broken jobs wait out 10 s collective timeouts

MUTATIONS = [
    # job 1: the fix must take every rank into the collective
    Mutation("job1 fix keeps the loss all_reduce inside the rank-0 branch",
             "        if step % LOG_EVERY == 0:\n            dist.all_reduce(loss)\n",
             "        if me.is_main and step % LOG_EVERY == 0:\n            dist.all_reduce(loss)\n",
             "job1_fixed", 2),  # a timeout, or (gloo aborts a rank sent too many bytes) wrong weights
    Mutation("job1 fix logs the sum of the losses, not their mean",
             "                logged.append(loss.item() / me.world_size)\n",
             "                logged.append(loss.item())\n",
             "4x too large", 4),
    Mutation("job1 fix drops the all_reduce: rank 0 logs its own shard's loss",
             "            dist.all_reduce(loss)\n            if me.is_main:\n"
             "                logged.append(loss.item() / me.world_size)\n",
             "            if me.is_main:\n                logged.append(loss.item())\n",
             "did every rank's loss enter the all_reduce?", 2),
    # job 2: unequal chunks
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
    Mutation("job2 fix still gathers chunks of unequal sizes",
             "    totals = torch.stack([errors.double().sum(),\n"
             "                          torch.tensor(errors.numel(), dtype=torch.float64, device=errors.device)])\n"
             "    dist.all_reduce(totals)\n    return (totals[0] / totals[1]).item()\n",
             "    gathered = [torch.empty_like(errors) for _ in range(me.world_size)]\n"
             "    dist.all_gather(gathered, errors)\n    return torch.cat(gathered).mean().item()\n",
             "all_gather of chunks of unequal sizes", 2),  # gloo: one rank aborts, one reads garbage
    # job 3: the skip must be collective
    Mutation("job3 fix skips the bad step on the bad rank alone",
             "        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=me.device)\n"
             "        dist.all_reduce(bad)\n        if bad.item() > 0:\n",
             "        if not torch.isfinite(loss):\n",
             "job3_fixed failed on rank", 2),
    Mutation("job3 fix skips only when every rank's loss is bad",
             "        if bad.item() > 0:\n", "        if bad.item() == me.world_size:\n",
             "the weights hold NaN", 3),
    # the diagnoses
    Mutation("job1 diagnosis blames a waiting rank", '"job1": {"rank": 0,', '"job1": {"rank": 1,',
             "diagnosis of job1: rank 1 is not the rank at fault", 2),
    Mutation("job2 diagnosis writes the last rank as a constant", '"rank": world_size - 1,', '"rank": 3,',
             "diagnosis of job2: rank 3 is not the rank at fault at 2 ranks", 2),
    Mutation("job1 diagnosis names a line that every rank runs", '"line": "dist.all_reduce(loss)"',
             '"line": "average_gradients_and_step(w, loss, me)"',
             "is not where the ranks part ways", 4),
    Mutation("job3 diagnosis names the line where the other ranks waited",
             """"line": 'raise FloatingPointError(f"the loss is {loss.item()} at sample {start} of my shard")'""",
             '"line": "dist.all_reduce(w.grad)"',
             "is not a line of job3_broken", 2),
    Mutation("job2 diagnosis gives no cause",
             '"cause": "1001 does not divide by the world size: the last chunk is shorter, and "\n'
             '                          "all_gather needs tensors of one shape on every rank"},',
             '"cause": ""},',
             "say in a sentence why it fails", 2),
]
NPROCS = (2, 4)
