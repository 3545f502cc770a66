"""Lab 03 - collectives: broadcast, gather and all_gather built from send and recv only.

Run it with 4 processes:
    make lab CH=03 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/03_collectives.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/03_collectives.py; edit that one.)

import torch
import torch.distributed as dist


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Like dist.broadcast(tensor, src): afterwards every rank's `tensor` holds what rank `src`
    had. In place: change `tensor` itself. Use dist.send and dist.recv only, and name the peer of
    every recv (NCCL has no receive from any source)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # (stuck? `make hint CH=03` prints hint 1 of 2; run it again for the next)
    # TODO: make every rank's `tensor` hold the root's values, the root's own unchanged
    raise NotImplementedError("the TODO above")


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int) -> None:
    """Like dist.gather(tensor, gather_list, dst): on rank `dst`, gather_list[r] receives rank
    r's tensor, for every r (dst included); on the other ranks gather_list is None.
    Use dist.send and dist.recv only, and name the peer of every recv."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # (stuck? `make hint CH=03` prints hint 1 of 2; run it again for the next)
    # TODO: fill the destination's gather_list (the tensors it holds, in place) with every rank's tensor, in rank order
    raise NotImplementedError("the TODO above")


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """Like dist.all_gather(tensor_list, tensor): on every rank, tensor_list[r] receives rank r's
    tensor. Build it as a ring: each rank talks to its two neighbours only; at each step post the
    send and the receive at once (dist.isend and dist.irecv, or both as dist.P2POp in one
    dist.batch_isend_irecv call) and wait for both before the next step. On NCCL use the batch: torch
    documents that within one batch the order of sends and receives cannot deadlock; one by one, it can."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    # (stuck? `make hint CH=03` prints hint 1 of 2; run it again for the next)
    # TODO: fill every slot of tensor_list (in place) with that rank's tensor, passing slots around the ring
    raise NotImplementedError("the TODO above")


if __name__ == "__main__":  # the check is in checks/lab03.py: you need not read it
    from checks import lab03
    lab03.run(broadcast=broadcast, gather=gather, all_gather=all_gather)
