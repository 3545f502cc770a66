"""Chapter 11: the mistakes its check must name."""

from mutation import Mutation

NPROCS = (2, 4)

MUTATIONS = [
    Mutation("no set_epoch", "        loader.sampler.set_epoch(epoch)\n", "",
             "call loader.sampler.set_epoch(epoch) each epoch"),
    Mutation("no DistributedSampler",
             "return DataLoader(train_set, batch_size=batch_per_rank, sampler=sampler, drop_last=True)",
             "return DataLoader(train_set, batch_size=batch_per_rank, shuffle=True, drop_last=True)",
             "did you use a DistributedSampler?"),
    Mutation("no SyncBatchNorm", "net = convert_sync_batchnorm(net).to(me.device)", "net = net.to(me.device)",
             "call convert_sync_batchnorm(net)"),
    Mutation("evaluation with DistributedSampler's padding",
             "mine = torch.arange(me.rank, len(test_set), me.world_size)",
             "mine = torch.tensor(list(DistributedSampler(test_set, me.world_size, me.rank, shuffle=False)))",
             "some images were counted twice"),
    Mutation("evaluation not all-reduced", "    dist.all_reduce(totals)\n", "",
             "did you all_reduce the totals?"),
    Mutation("torch.save straight onto the checkpoint",
             '    tmp = path.with_name(f".{path.name}.tmp")\n',
             '    tmp = path\n',
             "then os.replace it onto the path"),
    Mutation("weights_only=False", "map_location=device, weights_only=True)", "map_location=device, weights_only=False)",
             "pass weights_only=True"),
    Mutation("resume restarts the epoch", "batches = itertools.islice(loader, progress.step_in_epoch, None)",
             "batches = loader", "do not restart the epoch"),
    Mutation("optimizer state not restored", "    optimizer.load_state_dict(state[\"optimizer\"])\n", "",
             "restore the optimizer (momentum)"),
    Mutation("augmentation from the global random state",
             "    with torch.random.fork_rng(devices=[]):  # leave the global random state as it was\n"
             "        torch.manual_seed(seed)\n        return torch.stack",
             "    return torch.stack", "seed the augmentation from"),
]
