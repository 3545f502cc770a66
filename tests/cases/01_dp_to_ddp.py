"""Chapter 01: the classic ways to get DDP wrong, each of which the lab's check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("no DistributedSampler",
             "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
             "    return DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)\n",
             "    return DataLoader(dataset, batch_size=BATCH_PER_RANK, shuffle=True)\n",
             "give it sampler=DistributedSampler"),
    Mutation("no DDP wrap",
             '    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)\n',
             "    return model\n",
             "wrap the model in DistributedDataParallel so they are averaged"),
    Mutation("printing from every rank",
             '        if dist.get_rank() == 0:\n            print(f"epoch {epoch}: loss {total / batches:.4f}")\n',
             '        print(f"epoch {epoch}: loss {total / batches:.4f}")\n',
             "log from rank 0 only"),
    Mutation("no set_epoch", "        loader.sampler.set_epoch(epoch)\n", "        pass\n",
             "call loader.sampler.set_epoch(epoch)"),
    Mutation("sampler seed differs by rank", "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n",
             "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED + dist.get_rank())\n",
             "do not split the 480 samples exactly"),
]
