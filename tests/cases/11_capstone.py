"""Chapter 11: the mistakes its check must name."""

from mutation import Mutation

NPROCS = (2, 4)

MUTATIONS = [
    Mutation("no set_epoch", "        loader.sampler.set_epoch(epoch)\n", "",
             "call loader.sampler.set_epoch(epoch) each epoch"),
    Mutation("every rank samples the whole data set",
             "DistributedSampler(train_set, num_replicas=me.world_size, rank=me.rank, shuffle=True, seed=seed)\n",
             "DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)\n",
             "every rank trains on the whole data set"),
    Mutation("evaluation with DistributedSampler's padding",
             "mine = torch.arange(me.rank, len(test_set), me.world_size)",
             "mine = torch.tensor(list(DistributedSampler(test_set, me.world_size, me.rank, shuffle=False)))",
             "some images were counted twice"),
    Mutation("torch.save straight onto the checkpoint",
             '    tmp = path.with_name(f".{path.name}.tmp")\n',
             '    tmp = path\n',
             "then os.replace it onto the path"),
    Mutation("weights_only=False", "return torch.load(path, map_location=device, weights_only=True)",
             "return torch.load(path, map_location=device, weights_only=False)",
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
