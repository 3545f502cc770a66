"""Chapter 08: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("same seed on every rank", "rank_seed = seed + rank\n", "rank_seed = seed\n",
             "drew the same dropout mask", 2),
    Mutation("model seeded with the rank", "        torch.manual_seed(seed)\n        return Net()\n",
             "        torch.manual_seed(seed + dist.get_rank())\n        return Net()\n",
             "differ from rank 0's: build the model from the shared seed", 4),
    Mutation("shared seed without fork_rng",
             "    with torch.random.fork_rng(devices=[]):\n        torch.manual_seed(seed)\n        return Net()\n",
             "    torch.manual_seed(seed)\n    return Net()\n", "drew the same dropout mask", 2),
    Mutation("dataset generator not reseeded in workers",
             "    get_worker_info().dataset.rng = np.random.default_rng(worker_seed)\n", "",
             "DataLoader workers drew the same augmentations", 2),
    Mutation("loader generator without the rank", "generator = torch.Generator().manual_seed(seed + rank)",
             "generator = torch.Generator().manual_seed(seed)", "seed the loader's generator with seed + rank", 4),
    Mutation("unseeded worker generator", "rng = np.random.default_rng(worker_seed)", "rng = np.random.default_rng()",
             "a second run from the same seed gave different", 2),
]
