"""Chapter 06: the mistakes its check must name."""

from mutation import Mutation

LOOP = ("        sampler.set_epoch(epoch)\n        # END SOLUTION\n        order = []\n"
        "        for x, y, index in loader:\n            loss = F.cross_entropy(model(x.to(device)), y.to(device))\n"
        "            optimizer.zero_grad()\n            loss.backward()\n            optimizer.step()\n"
        "            order += index.tolist()\n")

MUTATIONS = [
    Mutation("epoch left out of the seed", "generator.manual_seed(seed + epoch)", "generator.manual_seed(seed)",
             "seed the generator with seed + epoch", 2),
    Mutation("a seed per rank", "generator.manual_seed(seed + epoch)", "generator.manual_seed(seed + epoch + rank)",
             "every rank must shuffle with the same generator seed", 2),
    Mutation("seed left out", "generator.manual_seed(seed + epoch)", "generator.manual_seed(epoch)",
             "the seed was left out", 2),
    Mutation("global RNG reseeded in the sampler",
             "        generator = torch.Generator()\n        generator.manual_seed(seed + epoch)\n"
             "        order = torch.randperm(n, generator=generator).tolist()\n",
             "        torch.manual_seed(seed + epoch)\n        order = torch.randperm(n).tolist()\n",
             "shard_indices changed torch's global random state", 2),
    Mutation("generator not passed to randperm", "order = torch.randperm(n, generator=generator)",
             "order = torch.randperm(n)",
             "the permutation came from torch's global generator", 2),
    Mutation("shuffle flag ignored", "    if shuffle:\n        generator", "    if True:\n        generator",
             "shuffled although shuffle=False", 2),
    Mutation("no padding", "        order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]\n",
             "", "pad the list by repeating indices from its start", 2),
    Mutation("padding repeats the list only once",
             "order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]",
             "order = order + order[:per_rank * num_replicas - n]", "the padding repeats the list more than once", 2),
    Mutation("drop_last rounds up", "per_rank = n // num_replicas", "per_rank = math.ceil(n / num_replicas)",
             "with drop_last=True every rank gets n // world_size samples", 2),
    Mutation("drop_last cuts the start", "order = order[:per_rank * num_replicas]",
             "order = order[n - per_rank * num_replicas:]", "cut at its start", 2),
    Mutation("contiguous blocks", "return order[rank::num_replicas]",
             "return order[rank * per_rank:(rank + 1) * per_rank]", "this rank took a contiguous block", 2),
    Mutation("forgot set_epoch", "missing line here\n        sampler.set_epoch(epoch)\n", "missing line here\n",
             "the loop never calls sampler.set_epoch(epoch)", 2),
    Mutation("set_epoch after the epoch", LOOP,
             LOOP.replace("        sampler.set_epoch(epoch)\n", "") + "        sampler.set_epoch(epoch)\n",
             "set_epoch is called, but too late", 2),
    Mutation("shuffle=True instead of the sampler", "DataLoader(dataset, batch_size=batch_size, sampler=sampler)",
             "DataLoader(dataset, batch_size=batch_size, shuffle=True)", "the whole data set", 2),
    Mutation("DistributedSampler seeded with the rank", "DistributedSampler(dataset, shuffle=True, seed=seed)",
             "DistributedSampler(dataset, shuffle=True, seed=seed + dist.get_rank())",
             "each rank shuffled with its own seed (seed + rank)", 3),
    Mutation("DistributedSampler without shuffle", "DistributedSampler(dataset, shuffle=True, seed=seed)",
             "DistributedSampler(dataset, shuffle=False, seed=seed)", "the sampler does not shuffle", 2),
]
