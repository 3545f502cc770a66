"""Chapter 06: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("epoch left out of the seed", "generator.manual_seed(seed + epoch)", "generator.manual_seed(seed)",
             "seed the generator with seed + epoch", 2),
    Mutation("a seed per rank", "generator.manual_seed(seed + epoch)", "generator.manual_seed(seed + epoch + rank)",
             "every rank must shuffle with the same generator seed", 2),
    Mutation("no padding", "        order = (order * math.ceil(per_rank * num_replicas / max(n, 1)))[:per_rank * num_replicas]\n",
             "", "pad the list by repeating indices from its start", 2),
    Mutation("drop_last rounds up", "per_rank = n // num_replicas", "per_rank = math.ceil(n / num_replicas)",
             "with drop_last=True every rank gets n // world_size samples", 2),
    Mutation("contiguous blocks", "return order[rank::num_replicas]",
             "return order[rank * per_rank:(rank + 1) * per_rank]", "this rank took a contiguous block", 2),
    Mutation("forgot set_epoch", "missing line here\n        sampler.set_epoch(epoch)\n", "missing line here\n",
             "the loop never calls sampler.set_epoch(epoch)", 2),
    Mutation("shuffle=True instead of the sampler", "DataLoader(dataset, batch_size=batch_size, sampler=sampler)",
             "DataLoader(dataset, batch_size=batch_size, shuffle=True)", "the whole data set", 2),
]
