"""Chapter 08: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("same seed on every rank", "rank_seed = seed + rank\n", "rank_seed = seed\n",
             "is seeded with the shared seed", 2),
    Mutation("NumPy not seeded", "    np.random.seed(rank_seed)\n", "",
             "call np.random.seed(seed + rank) in seed_everything", 2),
    Mutation("Python's random not seeded", "    random.seed(rank_seed)\n", "",
             "call random.seed(seed + rank) in seed_everything", 2),
    Mutation("torch not seeded", "    torch.manual_seed(rank_seed)\n", "",
             "call torch.manual_seed(seed + rank) in seed_everything", 2),
    Mutation("returns the shared seed", "    return rank_seed\n", "    return seed\n",
             "seed_everything returned 1234, expected seed + rank = 1235", 2),
    Mutation("model seeded with the rank", "        torch.manual_seed(seed)\n        return Net().to(device)\n",
             "        torch.manual_seed(seed + dist.get_rank())\n        return Net().to(device)\n",
             "differ from rank 0's: build the model from the shared seed", 4),
    Mutation("shared seed without fork_rng",
             "    with torch.random.fork_rng(devices=rank_devices):\n        torch.manual_seed(seed)\n"
             "        return Net().to(device)\n",
             "    torch.manual_seed(seed)\n    return Net().to(device)\n",
             "build_model changed this rank's random stream on cpu", 2),
    Mutation("dataset generator not reseeded in workers",
             "    get_worker_info().dataset.rng = np.random.default_rng(worker_seed)\n", "",
             "DataLoader workers drew the same augmentations", 2),
    Mutation("no worker_init_fn", "                      worker_init_fn=seed_worker, generator=generator)\n",
             "                      generator=generator)\n", "DataLoader workers drew the same augmentations", 2),
    Mutation("worker reseeded from worker_id", "    worker_seed = torch.initial_seed() % 2**32\n",
             "    worker_seed = worker_id\n", "not from worker_id", 2),
    Mutation("loader generator without the rank", "    generator = torch.Generator().manual_seed(seed + rank)\n",
             "    generator = torch.Generator().manual_seed(seed)\n", "seed the loader's generator with seed + rank", 4),
    Mutation("DistributedSampler seeded with the rank", "rank=rank, shuffle=True, seed=seed)\n",
             "rank=rank, shuffle=True, seed=seed + rank)\n", "DistributedSampler's seed must be the same on every rank", 3),
    Mutation("no workers", "sampler=sampler, num_workers=workers,", "sampler=sampler,", "all batches came from one worker", 2),
    Mutation("unseeded worker generator", "    get_worker_info().dataset.rng = np.random.default_rng(worker_seed)\n",
             "    get_worker_info().dataset.rng = np.random.default_rng()\n",
             "a second run from the same seed gave different", 2),
]
