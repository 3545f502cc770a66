"""Lab 03 - collectives: broadcast, gather and all_gather built from send and recv only.

Run it with 4 processes:
    make lab CH=03 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/03_collectives.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/03_collectives.py; edit that one.)

from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Like dist.broadcast(tensor, src): afterwards every rank's `tensor` holds what rank `src`
    had. In place: change `tensor` itself. Use dist.send and dist.recv only."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO: the root sends its tensor to every other rank; every other rank receives it from the root straight into `tensor`
    raise NotImplementedError("the TODO above")


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int) -> None:
    """Like dist.gather(tensor, gather_list, dst): on rank `dst`, gather_list[r] receives rank
    r's tensor, for every r (dst included); on the other ranks gather_list is None.
    Use dist.send and dist.recv only."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO: every rank but dst sends its tensor to dst; dst copies its own tensor into its slot and receives each other rank's tensor into that rank's slot
    raise NotImplementedError("the TODO above")


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """Like dist.all_gather(tensor_list, tensor): on every rank, tensor_list[r] receives rank r's
    tensor. Build it as a ring: copy your tensor into your own slot, then in N-1 steps pass to
    your right neighbour the slot you received last (at step s, rank r sends slot (r - s) % N
    and receives slot (r - s - 1) % N from its left neighbour). Use isend/irecv and wait on both
    at each step: with blocking calls every rank would send first and wait for ever."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    # TODO: copy your tensor into tensor_list[rank]; then for N-1 steps isend slot (rank - step) % N to the right, irecv slot (rank - step - 1) % N from the left, and wait on both
    raise NotImplementedError("the TODO above")


# -- the checks: the same inputs through your function and through torch.distributed's own --

SHAPES = [(5,), (3, 7), (2, 3, 5)]  # odd sizes: nothing divides evenly
DTYPES = [torch.float32, torch.int64, torch.float64]
SENTINEL = -1  # fills every output before the call: a slot still holding it was never written
COLLECTIVES = ("broadcast", "scatter", "gather", "all_gather", "all_gather_into_tensor", "reduce",
               "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "broadcast_object_list", "all_gather_object", "gather_object")


@contextmanager
def send_and_recv_only():
    """While the learner's functions run, any torch.distributed collective raises."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def refuse(name):
        def collective(*args, **kwargs):
            raise RuntimeError(f"dist.{name} was called: this lab builds collectives from "
                               f"dist.send/recv (or isend/irecv) only")
        return collective

    for name in COLLECTIVES:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def rank_tensor(rank: int, shape: tuple, dtype: torch.dtype, case: int) -> torch.Tensor:
    """Each rank's own input: seeded, different on every rank and in every case, never SENTINEL."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randint(0, 100, shape, generator=g).to(dtype) + 1000 * rank + 1


def who_holds(t: torch.Tensor, inputs: list[torch.Tensor]) -> str:
    """Name the tensor `t` turned out to be: a rank's input, the sentinel, or something else."""
    for r, x in enumerate(inputs):
        if torch.equal(t, x):
            return f"rank {r}'s tensor"
    if (t == SENTINEL).all():
        return "nothing (never written)"
    return "values that are no rank's tensor"


def check_broadcast(checks: Checks, inputs: list[torch.Tensor], what: str) -> None:
    """Exact equality (a broadcast only copies bytes) with dist.broadcast, from every root."""
    rank = dist.get_rank()
    for src in range(len(inputs)):
        mine, theirs = inputs[rank].clone(), inputs[rank].clone()
        with send_and_recv_only():
            broadcast(mine, src)
        dist.broadcast(theirs, src)
        if torch.equal(mine, theirs):
            checks.expect(True, "")
            continue
        held = who_holds(mine, inputs)
        if rank != src and torch.equal(mine, inputs[rank]):
            hint = ("this rank still holds its own tensor: broadcast works in place - receive "
                    "into `tensor` itself (assigning a new tensor to the name does not change the caller's)")
        elif rank == src:
            hint = "the root's own tensor must not change"
        else:
            hint = f"receive from rank {src}, the root"
        checks.fail(f"broadcast from rank {src} of {what}: rank {rank} holds {held}, expected "
                    f"rank {src}'s tensor: {hint}")


def check_gather(checks: Checks, inputs: list[torch.Tensor], what: str) -> None:
    """Exact equality with dist.gather, to every destination."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for dst in range(world_size):
        mine = [torch.full_like(inputs[rank], SENTINEL) for _ in range(world_size)] if rank == dst else None
        theirs = [torch.full_like(inputs[rank], SENTINEL) for _ in range(world_size)] if rank == dst else None
        with send_and_recv_only():
            gather(inputs[rank].clone(), mine, dst)
        dist.gather(inputs[rank].clone(), theirs, dst)
        if rank != dst:
            checks.expect(True, "")
            continue
        wrong = [i for i in range(world_size) if not torch.equal(mine[i], theirs[i])]
        if not wrong:
            checks.expect(True, "")
            continue
        slot = wrong[0]
        if slot == dst:
            hint = f"the destination's own slot: copy your tensor into gather_list[{dst}]"
        else:
            hint = f"receive rank {slot}'s tensor into gather_list[{slot}] (the list is in rank order)"
        checks.fail(f"gather to rank {dst} of {what}: gather_list[{slot}] holds "
                    f"{who_holds(mine[slot], inputs)}, expected rank {slot}'s tensor: {hint}")


def check_all_gather(checks: Checks, inputs: list[torch.Tensor], what: str) -> None:
    """Exact equality with dist.all_gather."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = [torch.full_like(inputs[rank], SENTINEL) for _ in range(world_size)]
    theirs = [torch.full_like(inputs[rank], SENTINEL) for _ in range(world_size)]
    with send_and_recv_only():
        all_gather(mine, inputs[rank].clone())
    dist.all_gather(theirs, inputs[rank].clone())
    wrong = [i for i in range(world_size) if not torch.equal(mine[i], theirs[i])]
    if not wrong:
        checks.expect(True, "")
        return
    slot = wrong[0]
    if all((t == SENTINEL).all() for t in mine):  # nothing real ever entered the ring
        hint = (f"every slot is empty: fill your own slot first (copy your tensor into "
                f"tensor_list[{rank}]), then the ring passes it on")
    elif wrong == [rank]:
        hint = f"your own slot: copy your tensor into tensor_list[{rank}] first"
    else:
        hint = ("off by one? at step s rank r sends slot (r - s) % N to the right and receives "
                "slot (r - s - 1) % N from the left")
    checks.fail(f"all_gather of {what} on rank {rank}: tensor_list[{slot}] holds "
                f"{who_holds(mine[slot], inputs)}, expected rank {slot}'s tensor: {hint}")


def main(me: Rank, checks: Checks) -> None:
    world_size = dist.get_world_size()
    case = 0
    for shape in SHAPES:
        for dtype in DTYPES:
            inputs = [rank_tensor(r, shape, dtype, case) for r in range(world_size)]
            what = f"a {tuple(shape)} {str(dtype).replace('torch.', '')} tensor"
            check_broadcast(checks, inputs, what)
            check_gather(checks, inputs, what)
            check_all_gather(checks, inputs, what)
            case += 1
            if checks.failures:  # the first case that fails tells enough: fix it and run again
                return
    print0(f"compared broadcast, gather and all_gather with torch.distributed's own: "
           f"{len(SHAPES)} shapes x {len(DTYPES)} dtypes, every root, {world_size} ranks")


# A short timeout: a send/recv that no rank matches fails in 10 s as a likely deadlock.
if __name__ == "__main__":
    run_lab(main, title="Lab 03 (collectives)", timeout=timedelta(seconds=10))
