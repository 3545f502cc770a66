"""Chapter 08: the mistakes its check must name."""

import torch
from mutation import Mutation, Variant

MODEL_BLOCK = ("    with torch.random.fork_rng(devices=rank_devices):\n        torch.manual_seed(seed)\n"
               "        return Net().to(device)\n")

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
             "        torch.manual_seed(seed + torch.distributed.get_rank())\n        return Net().to(device)\n",
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
    Mutation("stream reseeded with seed + rank after building", MODEL_BLOCK,
             "    torch.manual_seed(seed)\n    model = Net().to(device)\n    torch.manual_seed(seed + torch.distributed.get_rank())\n"
             "    return model\n", "build_model reseeded this rank's torch stream with seed + rank", 2),
    Mutation("seed_everything inside fork_rng", "        torch.manual_seed(seed)\n        return Net().to(device)\n",
             "        seed_everything(seed, 0)\n        return Net().to(device)\n",
             "build_model changed this rank's Python random and NumPy streams", 2),
    Mutation("Net built after the fork_rng block", "        torch.manual_seed(seed)\n        return Net().to(device)\n",
             "        torch.manual_seed(seed)\n    return Net().to(device)\n",
             "drew the Net's initial weights from this rank's own stream", 2),
    Mutation("64-bit seed for np.random.seed", "    worker_seed = torch.initial_seed() % 2**32\n",
             "    worker_seed = torch.initial_seed()\n", "seed with torch.initial_seed() % 2**32", 2),
    Mutation("worker seeds fixed across epochs", "    worker_seed = torch.initial_seed() % 2**32\n",
             "    worker_seed = 1234 + 10 * torch.distributed.get_rank() + worker_id\n",
             "epoch 1 drew the same augmentations as epoch 0", 2),
    Mutation("no DistributedSampler", "batch_size=batch_size, sampler=sampler, num_workers=workers,",
             "batch_size=batch_size, shuffle=True, num_workers=workers,", "the DataLoader needs a DistributedSampler", 2),
    Mutation("DistributedSampler without the seed", "rank=rank, shuffle=True, seed=seed)\n", "rank=rank, shuffle=True)\n",
             "the order of the samples ignores the seed", 2),
    Mutation("loader generator from torch.manual_seed", "    generator = torch.Generator().manual_seed(seed + rank)\n",
             "    generator = torch.manual_seed(seed + rank)\n", "torch.manual_seed returns that global generator", 2),
]

if not torch.cuda.is_available():  # where GPUs exist this is the right answer
    MUTATIONS.append(Mutation("fork_rng given the CPU device", "    with torch.random.fork_rng(devices=rank_devices):\n",
                              "    with torch.random.fork_rng(devices=[device]):\n",
                              "build_model reached for a GPU on a CPU-only rank", 2))

# The chapter's headline bug, which a CPU run cannot show: the check rehearses build_model with cuda:0
MUTATIONS += [
    Mutation("fork_rng(devices=[]) whatever the device",
             '    rank_devices = [device] if device.type == "cuda" else []  # the GPU generator this rank draws from\n',
             "    rank_devices = []\n", "on a GPU, build_model would reset this rank's CUDA generator", 2),
    Mutation("fork_rng imported by name, devices=[]",
             "    with torch.random.fork_rng(devices=rank_devices):\n",
             "    from torch.random import fork_rng\n    with fork_rng(devices=[]):\n",
             "fork_rng puts back only the generators of the devices it is given", 3),
]
CORRECT = [
    Variant("fork_rng over every device (devices left out)", "    with torch.random.fork_rng(devices=rank_devices):\n",
            "    with torch.random.fork_rng():\n", 2),
    # chapter 08 cell 17's own recipe: only the CPU generator is seeded, the Net is drawn on the CPU
    Variant("the chapter's recipe: fork_rng(devices=[]) and the CPU's default_generator", MODEL_BLOCK.replace(
        "    with", '    rank_devices = [device] if device.type == "cuda" else []  # the GPU generator this rank draws from\n    with'),
            "    with torch.random.fork_rng(devices=[]):  # only the CPU generator is touched\n"
            "        torch.random.default_generator.manual_seed(seed)\n"
            "        model = Net()  # Net() draws its weights on the CPU\n"
            "    return model.to(device)\n", 2),
    Variant("states saved and restored by hand, the GPU's included", MODEL_BLOCK.replace(
        "    with", '    rank_devices = [device] if device.type == "cuda" else []  # the GPU generator this rank draws from\n    with'),
            "    cpu_state = torch.get_rng_state()\n"
            "    gpu_state = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None\n"
            "    torch.manual_seed(seed)\n"
            "    model = Net().to(device)\n"
            "    torch.set_rng_state(cpu_state)\n"
            "    if gpu_state is not None:\n"
            "        torch.cuda.set_rng_state(gpu_state, device)\n"
            "    return model\n", 2),
    Variant("every GPU's state saved and restored (get/set_rng_state_all)", MODEL_BLOCK,
            "    states = torch.get_rng_state(), torch.cuda.get_rng_state_all() if device.type == 'cuda' else []\n"
            "    torch.manual_seed(seed)\n    model = Net().to(device)\n"
            "    torch.set_rng_state(states[0])\n"
            "    if device.type == 'cuda':\n        torch.cuda.set_rng_state_all(states[1])\n"
            "    return model\n", 2),
    Variant("workers kept from epoch to epoch (persistent_workers=True)", "sampler=sampler, num_workers=workers,",
            "sampler=sampler, num_workers=workers, persistent_workers=True,", 2),
    Variant("seeded generator by generator", "    torch.manual_seed(rank_seed)\n",
            "    torch.random.default_generator.manual_seed(rank_seed)\n    torch.cuda.manual_seed_all(rank_seed)\n", 2),
]

MUTATIONS += [
    # A GPU would show these; a stand-in GPU whose generator has its own state shows them on a CPU
    Mutation("CPU state saved by hand, the GPU's forgotten", MODEL_BLOCK,
             "    state = torch.get_rng_state()\n    torch.manual_seed(seed)\n    model = Net()\n"
             "    torch.set_rng_state(state)\n    return model.to(device)\n",
             "on a GPU, build_model would reset this rank's CUDA generator to the shared seed", 2),
    Mutation("the chapter's recipe, the GPUs seeded too \"for safety\"", MODEL_BLOCK,
             "    with torch.random.fork_rng(devices=[]):\n        torch.random.default_generator.manual_seed(seed)\n"
             "        torch.cuda.manual_seed_all(seed)\n        model = Net()\n    return model.to(device)\n",
             "on a GPU, build_model would reset this rank's CUDA generator to the shared seed", 2),
    Mutation("only the CPU generator seeded in seed_everything", "    torch.manual_seed(rank_seed)\n",
             "    torch.random.default_generator.manual_seed(rank_seed)\n",
             "on a GPU, seed_everything would leave this rank's CUDA generator unseeded", 2),
    # no generator=: the workers' base seed is drawn from the global stream when an epoch starts
    Mutation("DataLoader without generator=", "                      worker_init_fn=seed_worker, generator=generator)\n",
             "                      worker_init_fn=seed_worker)\n",
             "starting to read the loader moved this rank's global torch stream", 2),
    Mutation("worker seed keeps only the high bits", "    worker_seed = torch.initial_seed() % 2**32\n",
             "    worker_seed = torch.initial_seed() >> 32\n",
             "the seeds seed_worker derives from it coincide for two workers", 2),
]

NODES = True  # LOCAL_RANK and the rank's device
