"""Lab 15 - a hierarchical all-reduce: sum inside each host first, send only a shard across hosts.

Hosts are simulated on one machine: consecutive blocks of `ranks_per_host` ranks form a host, as
torchrun numbers the ranks of a multi-node job (--ranks-per-host N; by default 2 on an even number of
4 ranks or more, else 1; on a real multi-node job pass LOCAL_WORLD_SIZE). Fill in the TODOs in order:
the layout of hosts and peers, their process groups, then the all-reduce in two levels. The given
code below them trains a model with DDP whose communication hook is your all-reduce. The check
compares your all-reduce with dist.all_reduce on every layout of 1-4 hosts x 1-3 ranks per host that
fits the number of ranks (sizes that do not divide included), counts the bytes each rank sends
across hosts, and compares the training with plain DDP.

Run it with 4 processes:
    make lab CH=15 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/15_hierarchy.py)
"""
# SOLUTION FILE

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# --- Your part 1: hosts and peers -----------------------------------------------------------------


def host_layout(world_size: int, ranks_per_host: int) -> tuple[list[list[int]], list[list[int]]]:
    """The two ways to group the ranks of world_size // ranks_per_host hosts, ranks numbered host by
    host (host h holds ranks h * ranks_per_host ... (h + 1) * ranks_per_host - 1, as torchrun numbers
    a multi-node job). Returns (hosts, peers): hosts[h] lists the ranks of host h in order; peers[i]
    lists the ranks with local index i, one per host, in host order.
    6 ranks, 3 per host: hosts [[0, 1, 2], [3, 4, 5]], peers [[0, 3], [1, 4], [2, 5]].
    Raises ValueError when world_size is not a multiple of ranks_per_host."""
    # HINT 1: a rank's host is rank // ranks_per_host and its local index rank % ranks_per_host; hosts is the list of consecutive blocks, peers takes one rank from each block
    # HINT 2: hosts = [list(range(h * L, (h + 1) * L)) for h in range(H)]; peers = [list(range(i, world_size, L)) for i in range(L)]
    # BEGIN SOLUTION: return (hosts, peers) as the docstring says, and refuse a world size that is not a whole number of hosts
    if ranks_per_host < 1 or world_size % ranks_per_host != 0:
        raise ValueError(f"{world_size} ranks do not make whole hosts of {ranks_per_host} ranks")
    hosts = [list(range(h * ranks_per_host, (h + 1) * ranks_per_host)) for h in range(world_size // ranks_per_host)]
    peers = [list(range(i, world_size, ranks_per_host)) for i in range(ranks_per_host)]
    return hosts, peers
    # END SOLUTION


def make_groups(world_size: int, ranks_per_host: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create a process group for every host and for every set of peers (host_layout), and return
    the two that this rank belongs to: (its host's group, its peers' group). Every rank calls it with
    the same arguments at the same time."""
    hosts, peers = host_layout(world_size, ranks_per_host)
    rank = dist.get_rank()
    # HINT 1: dist.new_group(ranks) makes a group, and it is collective: every rank of the job must call it for every group, in the same order, even for the groups it is not part of
    # HINT 2: groups = [dist.new_group(r) for r in hosts + peers]; keep the one of hosts[rank // ranks_per_host] and the one of peers[rank % ranks_per_host]
    # BEGIN SOLUTION: make one group per host and one per set of peers on every rank alike; return (this rank's host group, this rank's peers group)
    host_groups = [dist.new_group(ranks) for ranks in hosts]
    peer_groups = [dist.new_group(ranks) for ranks in peers]
    return host_groups[rank // ranks_per_host], peer_groups[rank % ranks_per_host]
    # END SOLUTION


# --- Your part 2: the all-reduce in two levels ----------------------------------------------------


def hierarchical_all_reduce(tensor: torch.Tensor, host_group, peer_group) -> torch.Tensor:
    """Sum a contiguous `tensor` over all ranks, in place, and return it: any number of elements (it
    need not divide by the ranks per host), any dtype that dist.all_reduce sums.

    Two levels: inside a host (host_group: the fast link) and across hosts (peer_group: the slow link).
    Across hosts, each rank may send only its share: about 1/ranks_per_host of the tensor, in one
    all-reduce over its peers. Collectives only on these two groups, never on the default group."""
    flat = tensor.view(-1)
    local = dist.get_world_size(host_group)
    # HINT 1: a reduce-scatter over the host needs a length that divides by the ranks per host: copy the tensor into a buffer padded with zeros up to ceil(numel / L) * L elements (no padding when numel divides)
    # HINT 2: shard = -(-flat.numel() // local); padded = torch.zeros(shard * local, dtype=flat.dtype, device=flat.device); padded[:flat.numel()] = flat
    # BEGIN SOLUTION: `padded`, a buffer that the host's reduce-scatter can split into equal shards, holding `flat` and nothing that changes the sum, no longer than it must be; and `shard`, one shard's size
    shard = -(-flat.numel() // local)  # ceil: zeros pad the last shard
    padded = torch.zeros(shard * local, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    # END SOLUTION
    # HINT 1: three collectives: the host sums and splits (each rank keeps one summed shard), each shard is summed across hosts among peers (they hold the same shard index), the host puts the shards back together
    # HINT 2: dist.reduce_scatter_tensor(mine, padded, group=host_group); dist.all_reduce(mine, group=peer_group); dist.all_gather_into_tensor(padded, mine, group=host_group), with mine = torch.empty(shard, ...)
    # BEGIN SOLUTION: leave in `padded` the sum over all ranks, sending across hosts (peer_group) only this rank's shard
    mine = torch.empty(shard, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_tensor(mine, padded, group=host_group)  # fast link: the host's sum, one shard each
    dist.all_reduce(mine, group=peer_group)  # slow link: 1/local of the tensor per rank
    dist.all_gather_into_tensor(padded, mine, group=host_group)  # fast link: every shard on every rank
    # END SOLUTION
    # HINT 1: the caller keeps `tensor`: the sum must land in it, without the padding
    # BEGIN SOLUTION: copy the sum (without the padding) into `tensor` itself
    flat.copy_(padded[:flat.numel()])
    # END SOLUTION
    return tensor


# --- The training that uses it (given) ------------------------------------------------------------

SEED = 0
STEPS = 4
BATCH_PER_RANK = 8


def ranks_per_host(world_size: int) -> int:
    """--ranks-per-host, else 2 when there are 4 ranks or more and their number is even, else 1."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks-per-host", type=int, default=None)
    given = parser.parse_known_args()[0].ranks_per_host
    return given if given is not None else (2 if world_size >= 4 and world_size % 2 == 0 else 1)


def hierarchical_hook(groups, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: average the bucket with hierarchical_all_reduce (chapter 12)."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    hierarchical_all_reduce(buffer, *groups)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))  # 77 + 24 parameters: uneven


def train(device: torch.device, groups=None) -> torch.Tensor:
    """STEPS of SGD with DDP on this rank's batches, on `device`; with `groups`, DDP sends through
    hierarchical_hook. Returns the final weights, flat."""
    model = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    if groups is not None:
        model.register_comm_hook(groups, hierarchical_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        x = torch.randn(BATCH_PER_RANK, 10, generator=generator).to(device)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


if __name__ == "__main__":  # the check is in checks/lab15.py: you need not read it
    from checks import lab15
    lab15.run(host_layout=host_layout, make_groups=make_groups, hierarchical_all_reduce=hierarchical_all_reduce,
              ranks_per_host=ranks_per_host, train=train)
