"""Chapter 01: the classic ways to get DDP wrong, each of which the lab's check must name."""

from pathlib import Path

from mutation import Mutation, Variant

SOLUTION = (Path(__file__).resolve().parents[2] / "solutions" / "01_dp_to_ddp.py").read_text()

SAMPLER = "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
LOADER = "    return DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)\n"

DDP_LINE = '    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)\n'
INIT = "    dist.init_process_group(backend, timeout=timedelta(seconds=30))\n"
DEVICE = '    return device_for(device_type, int(os.environ["LOCAL_RANK"]))\n'
SET_EPOCH = "        loader.sampler.set_epoch(epoch)\n"
PRINT = '        if dist.get_rank() == 0:\n            print(f"epoch {epoch}: loss {total / batches:.4f}")\n'
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
    # REVIEW 3, F: with SEED = 0, the sampler's default, leaving seed= out passed
    Mutation("sampler seed left out", SAMPLER,
             "    sampler = DistributedSampler(dataset, shuffle=True)\n",
             "seed= was left out", 2),
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
    # Found by trying what learners write (each was passed, misnamed, a raw crash or a gloo abort before).
    Mutation("no timeout for the group", INIT, "    dist.init_process_group(backend)\n",
             "PyTorch's default timeout", 2),
    Mutation("the chapter's NCCL snippet on a CPU machine", INIT + DEVICE,
             '    local_rank = int(os.environ["LOCAL_RANK"])\n    torch.cuda.set_device(local_rank)\n'
             '    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))\n'
             '    return torch.device("cuda", local_rank)\n',
             "take the backend and device type from pick_backend()", 2),
    Mutation("setup() returns ringside's Rank", INIT + DEVICE,
             "    from ringside import init_distributed\n    return init_distributed()\n",
             "setup() returned a Rank, not a torch.device", 2),
    Mutation("setup() returns the device type string", DEVICE, "    return device_type\n",
             "setup() returned 'cpu', not a torch.device", 2),
    Mutation("a CPU device numbered by rank", DEVICE,
             '    return torch.device(device_type, int(os.environ["LOCAL_RANK"]))\n',
             "a CPU has no index", 2),
    Mutation("data split by hand", SAMPLER + LOADER,
             "    rank, world_size = dist.get_rank(), dist.get_world_size()\n"
             "    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))\n"
             "    return DataLoader(shard, batch_size=BATCH_PER_RANK, shuffle=True)\n",
             "a split by hand", 2),
    Mutation("device_ids on a CPU model", DDP_LINE,
             '    return DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])])\n',
             "on the CPU leave them out (device_ids=None)", 2),
    Mutation("set_epoch on rank 0 only", SET_EPOCH,
             "        if dist.get_rank() == 0:\n            loader.sampler.set_epoch(epoch)\n",
             "set_epoch(epoch) on every rank", 4),
    Mutation("loss averaged on rank 0 only (a collective on one rank)", PRINT,
             '        if dist.get_rank() == 0:\n            mean = torch.tensor([total / batches])\n'
             '            dist.all_reduce(mean)\n'
             '            print(f"epoch {epoch}: loss {mean.item() / dist.get_world_size():.4f}")\n',
             "a collective that only some ranks call", 4),
    Mutation("an error on rank 0 only (the others must not wait for the timeout)", PRINT,
             '        if dist.get_rank() == 0:\n            print(f"epoch {epoch}: loss {total / batch:.4f}")\n',
             "fix the error of rank 0 first", 2),
    Mutation("rank 0's print condition never holds", PRINT,
             '        if device.index == 0:\n            print(f"epoch {epoch}: loss {total / batches:.4f}")\n',
             "the print's condition must hold on rank 0", 2),
]

NODES = True  # LOCAL_RANK and the rank's device

# train()'s epoch from its set_epoch through its print: where an epoch's order is chosen, start or end
EPOCH_SPAN = SOLUTION[SOLUTION.index(SET_EPOCH):SOLUTION.index(PRINT) + len(PRINT)]
# REVIEW 5, m4: set_epoch(epoch) at the END of each epoch, so epoch 0's order is used twice
MUTATIONS.append(Mutation("set_epoch(epoch) at the end of each epoch", EPOCH_SPAN,
                          EPOCH_SPAN.replace(SET_EPOCH, "        pass\n") + SET_EPOCH,
                          "took its samples in the same order as epoch 0", 2))

# make_loader's body through train()'s set_epoch: a loader built on a batch_sampler is told its epoch there
BATCH_SAMPLER_SPAN = SOLUTION[SOLUTION.index(SAMPLER):SOLUTION.index("        loader.sampler.set_epoch(epoch)\n") + 40]

CORRECT = [
    Variant("the group joined with every setting spelled out",
            "    dist.init_process_group(backend, timeout=timedelta(seconds=30))\n",
            '    dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),\n'
            '                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(minutes=2))\n', 3),
    Variant("the sampler told the group's size and rank, and a BatchSampler over it", BATCH_SAMPLER_SPAN,
            BATCH_SAMPLER_SPAN.replace(SAMPLER + LOADER,
            "    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),\n"
            "                                 shuffle=True, seed=SEED, drop_last=False)\n"
            "    batches = torch.utils.data.BatchSampler(sampler, BATCH_PER_RANK, drop_last=False)\n"
            "    return DataLoader(dataset, batch_sampler=batches)\n").replace(
                "        loader.sampler.set_epoch(epoch)\n", "        loader.batch_sampler.sampler.set_epoch(epoch)\n"), 3),
    Variant("DDP with the CPU's defaults and gradients as bucket views", DDP_LINE,
            "    return DDP(model, gradient_as_bucket_view=True) if device.type == 'cpu' else DDP(model, device_ids=[device])\n", 3),
    Variant("the epoch's loss averaged over the ranks, printed by rank 0",
            '        if dist.get_rank() == 0:\n            print(f"epoch {epoch}: loss {total / batches:.4f}")\n',
            "        mean = torch.tensor([total / batches], device=device)\n"
            "        dist.all_reduce(mean, op=dist.ReduceOp.AVG)\n"
            '        if int(os.environ["RANK"]) == 0:\n            print(f"epoch {epoch}: loss {mean.item():.4f}")\n', 3),
    # REVIEW 5, v4: set_epoch(epoch + 1) at the end of each epoch uses the same orders as set_epoch(epoch)
    # at the start (it was rejected for the sampler's last epoch, not for the orders used)
    Variant("set_epoch(epoch + 1) at the end of each epoch", EPOCH_SPAN,
            EPOCH_SPAN.replace(SET_EPOCH, "        pass\n") + "        loader.sampler.set_epoch(epoch + 1)\n", 2),
]

# Right on gloo, wrong on a GPU machine: seen when the check runs it again on a stand-in GPU
MUTATIONS += [
    Mutation("the model never moved to the device", "    model = model.to(device)\n", "",
             "DDP refused the model", 2),
    Mutation("the labels left on the CPU", "            x, y = x.to(device), y.to(device)\n",
             "            x = x.to(device)\n", "found at least two devices", 2),
    Mutation("setup returns the CPU whatever the backend",
             '    return device_for(device_type, int(os.environ["LOCAL_RANK"]))\n',
             '    return torch.device("cpu")\n', "returned cpu, not this rank's GPU", 2),
]
