"""Chapter 01: the classic ways to get DDP wrong, each of which the lab's check must name."""

from pathlib import Path

from mutation import Mutation

SOLUTION = (Path(__file__).resolve().parents[2] / "solutions" / "01_dp_to_ddp.py").read_text()

SAMPLER = "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
LOADER = "    return DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)\n"

DDP_LINE = '    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)\n'
_span = SOLUTION[SOLUTION.index(LOADER):SOLUTION.index(DDP_LINE) + len(DDP_LINE)]
WORKERS_AND_NO_DDP = (_span, _span.replace("sampler=sampler)", "sampler=sampler, num_workers=2)")
                      .replace(DDP_LINE, "    return model\n"))

MUTATIONS = [
    Mutation("no DistributedSampler", SAMPLER + LOADER,
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
    Mutation("set_epoch(0) every epoch", "        loader.sampler.set_epoch(epoch)\n",
             "        loader.sampler.set_epoch(0)\n", "call loader.sampler.set_epoch(epoch)", 2),
    Mutation("sampler seed differs by rank", SAMPLER,
             "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED + dist.get_rank())\n",
             "every rank must shuffle with the same seed", 3),
    # REVIEW D: was blamed on "the sampler's seed and the learning rate"
    Mutation("global batch instead of per-rank batch", LOADER,
             "    return DataLoader(dataset, batch_size=BATCH_PER_RANK * dist.get_world_size(), sampler=sampler)\n",
             "that is the global batch", 2),
    Mutation("global batch split by hand", LOADER,
             "    return DataLoader(dataset, batch_size=BATCH_PER_RANK // dist.get_world_size(), sampler=sampler)\n",
             "you divided the batch by world_size", 4),
    # REVIEW D: was told "call set_epoch"
    Mutation("DistributedSampler(shuffle=False)", SAMPLER,
             "    sampler = DistributedSampler(dataset, shuffle=False, seed=SEED)\n",
             "has shuffle=False", 2),
    # REVIEW D: num_workers > 0 crashed inside the check; now the check still sees (and names) the mistake
    Mutation("num_workers=2 and no DDP wrap (the check must not crash)", WORKERS_AND_NO_DDP[0],
             WORKERS_AND_NO_DDP[1], "wrap the model in DistributedDataParallel so they are averaged", 2),
    Mutation("sampler told one replica", SAMPLER,
             "    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)\n",
             "leave both out", 2),
    Mutation("a GPU device on a CPU machine", '    return device_for(device_type, int(os.environ["LOCAL_RANK"]))\n',
             '    return torch.device("cuda", int(os.environ["LOCAL_RANK"]))\n',
             "take the device type from pick_backend()", 2),
    Mutation("forgot to join the group", "    dist.init_process_group(backend, timeout=timedelta(seconds=30))\n",
             "", "call dist.init_process_group", 2),
]
