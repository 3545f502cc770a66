"""Chapter 06: the mistakes its check must name."""

from mutation import Mutation, Variant

SHUFFLE = ("    if shuffle:\n        generator = torch.Generator()\n        generator.manual_seed(seed + epoch)\n"
           "        order = torch.randperm(n, generator=generator).tolist()\n    else:\n        order = list(range(n))\n")
SHARE = ("    if drop_last:\n        per_rank = n // num_replicas\n        order = order[:per_rank * num_replicas]\n"
         "    else:\n        per_rank = math.ceil(n / num_replicas)\n"
         "        order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]\n")
# the learner's version: pad (or cut) 0..n-1 first, then shuffle the padded list
SHUFFLED_LAST = ("    order = list(range(n))\n" + SHARE + "    if shuffle:\n        generator = torch.Generator()\n"
                 "        generator.manual_seed(seed + epoch)\n"
                 "        order = [order[i] for i in torch.randperm(len(order), generator=generator).tolist()]\n")

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
    Mutation("forgot set_epoch", "with what you expect\n        sampler.set_epoch(epoch)\n",
             "with what you expect\n",
             "every epoch read the same samples in the same order", 2),
    Mutation("set_epoch after the epoch", LOOP,
             LOOP.replace("        sampler.set_epoch(epoch)\n", "") + "        sampler.set_epoch(epoch)\n",
             "each new order arrives one epoch late", 2),
    Mutation("shuffle=True instead of the sampler", "DataLoader(dataset, batch_size=batch_size, sampler=sampler)",
             "DataLoader(dataset, batch_size=batch_size, shuffle=True)", "the whole data set", 2),
    Mutation("DistributedSampler seeded with the rank", "DistributedSampler(dataset, shuffle=True, seed=seed)",
             "DistributedSampler(dataset, shuffle=True, seed=seed + dist.get_rank())",
             "each rank shuffled with its own seed (seed + rank)", 3),
    Mutation("DistributedSampler without shuffle", "DistributedSampler(dataset, shuffle=True, seed=seed)",
             "DistributedSampler(dataset, shuffle=False, seed=seed)", "the sampler does not shuffle", 2),
    Mutation("shuffled after padding", SHUFFLE + SHARE, SHUFFLED_LAST,
             "the list was shuffled after it was padded (or cut)", 4),
    Mutation("each rank shuffles its own share", SHUFFLE + SHARE + "    return order[rank::num_replicas]\n",
             "    order = list(range(n))\n" + SHARE + "    mine = order[rank::num_replicas]\n    if shuffle:\n"
             "        generator = torch.Generator().manual_seed(seed + epoch)\n"
             "        mine = [mine[i] for i in torch.randperm(len(mine), generator=generator).tolist()]\n"
             "    return mine\n",
             "each rank shuffled its own share", 3),
    Mutation("padding from the unshuffled start",
             "order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]",
             "order = (order + list(range(n)) * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]",
             "the padding repeats 0, 1, 2, ... (the start of the unshuffled list)", 2),
]

PAD = "        order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]\n"
CORRECT = [
    Variant("padding by position modulo n", PAD,
            "        order = [order[i % n] for i in range(per_rank * num_replicas)] if n else []\n", 2),
    Variant("a generator seeded in one expression",
            "        generator = torch.Generator()\n        generator.manual_seed(seed + epoch)\n"
            "        order = torch.randperm(n, generator=generator).tolist()\n",
            "        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()\n", 2),
    Variant("this rank's positions listed one by one", "    return order[rank::num_replicas]\n",
            "    return [order[i] for i in range(rank, len(order), num_replicas)]\n", 3),
    Variant("the epoch told through the loader", "with what you expect\n        sampler.set_epoch(epoch)\n",
            "with what you expect\n        loader.sampler.set_epoch(epoch)\n", 2),
]
