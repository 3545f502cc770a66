"""Lab 03 - collectives: broadcast, gather and all_gather built from send and recv only.

Run it with 4 processes:
    make lab CH=03 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/03_collectives.py)
"""
# SOLUTION FILE

import torch
import torch.distributed as dist


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Like dist.broadcast(tensor, src): afterwards every rank's `tensor` holds what rank `src`
    had. In place: change `tensor` itself. Use dist.send and dist.recv only, and name the peer of
    every recv (NCCL has no receive from any source)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # HINT 1: the root is `src`, whichever rank that is; only it sends, once to each other rank, and the others receive into the very tensor they were given
    # HINT 2: if rank == src: dist.send(tensor, dst=peer) for every peer != src; else: dist.recv(tensor, src=src)
    # BEGIN SOLUTION: make every rank's `tensor` hold the root's values, the root's own unchanged
    if rank == src:
        for peer in range(world_size):
            if peer != src:
                dist.send(tensor, dst=peer)
    else:
        dist.recv(tensor, src=src)
    # END SOLUTION


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int) -> None:
    """Like dist.gather(tensor, gather_list, dst): on rank `dst`, gather_list[r] receives rank
    r's tensor, for every r (dst included); on the other ranks gather_list is None.
    Use dist.send and dist.recv only, and name the peer of every recv."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # HINT 1: messages from different senders may arrive in any order: receive from one named rank at a time, into that rank's slot; the destination's own slot needs no message
    # HINT 2: on dst: gather_list[dst].copy_(tensor), then dist.recv(gather_list[peer], src=peer) for every other peer; elsewhere: dist.send(tensor, dst=dst)
    # BEGIN SOLUTION: fill the destination's gather_list (the tensors it holds, in place) with every rank's tensor, in rank order
    if rank == dst:
        gather_list[dst].copy_(tensor)
        for peer in range(world_size):
            if peer != dst:
                dist.recv(gather_list[peer], src=peer)
    else:
        dist.send(tensor, dst=dst)
    # END SOLUTION


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """Like dist.all_gather(tensor_list, tensor): on every rank, tensor_list[r] receives rank r's
    tensor. Build it as a ring: each rank talks to its two neighbours only; at each step post the
    send and the receive at once (dist.isend and dist.irecv, or both as dist.P2POp in one
    dist.batch_isend_irecv call) and wait for both before the next step. On NCCL use the batch: torch
    documents that within one batch the order of sends and receives cannot deadlock; one by one, it can."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    # HINT 1: N-1 steps; at each, send one slot to the right neighbour and receive one from the left, at once (with blocking calls every rank would send first and wait for ever), and wait for both before the next step. Start with your own tensor in your own slot; at each step send on the slot that arrived at the step before (at step 0: your own)
    # HINT 2: at step s rank r sends slot (r - s) % N to the right and receives slot (r - s - 1) % N from the left: ops = [dist.P2POp(dist.isend, ..., right), dist.P2POp(dist.irecv, ..., left)], then wait on every request of dist.batch_isend_irecv(ops) (or wait on a dist.isend and a dist.irecv)
    # BEGIN SOLUTION: fill every slot of tensor_list (in place) with that rank's tensor, passing slots around the ring
    tensor_list[rank].copy_(tensor)
    for step in range(world_size - 1):
        send_slot, recv_slot = (rank - step) % world_size, (rank - step - 1) % world_size
        ops = [dist.P2POp(dist.isend, tensor_list[send_slot], right),
               dist.P2POp(dist.irecv, tensor_list[recv_slot], left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    # END SOLUTION


if __name__ == "__main__":  # the check is in checks/lab03.py: you need not read it
    from checks import lab03
    lab03.run(broadcast=broadcast, gather=gather, all_gather=all_gather)
