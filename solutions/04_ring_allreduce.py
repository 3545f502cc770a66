"""Lab 04 - a ring all-reduce written by hand, then a home-made DDP that averages gradients with it.

Fill in the TODOs in order: split a tensor into chunks, swap chunks with your neighbours, run the
two phases of the ring, then use your ring to average a model's gradients. The check compares
your ring with dist.all_reduce (odd sizes, several dtypes) and your training with DDP, step by step.

Run it with 4 processes:
    make lab CH=04 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/04_ring_allreduce.py)
"""
# SOLUTION FILE

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ringside.compare import flat_grads, flat_params

# --- Your part 1: the ring ------------------------------------------------------------------------


def ring_chunks(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split the 1-D tensor `flat` into `world_size` consecutive views (not copies) whose sizes
    differ by at most one: the first numel % world_size chunks get one extra element.
    10 elements on 4 ranks: sizes 3, 3, 2, 2. 3 elements on 4 ranks: 1, 1, 1, 0."""
    # HINT 1: divmod(flat.numel(), world_size) gives the base size and how many chunks get one more; slicing makes views. flat.chunk(world_size) is not it: 5 elements on 4 ranks give only 3 chunks
    # HINT 2: sizes = [base + (1 if i < extra else 0) for i in range(world_size)]; chunk i is flat[start:start + sizes[i]] with start the sum of the sizes before it
    # BEGIN SOLUTION: return exactly world_size views of consecutive pieces of `flat`, sized as the docstring says
    base, extra = divmod(flat.numel(), world_size)
    sizes = [base + (1 if i < extra else 0) for i in range(world_size)]
    starts = [sum(sizes[:i]) for i in range(world_size)]
    return [flat[start:start + size] for start, size in zip(starts, sizes)]
    # END SOLUTION


def send_right_receive_left(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
    """Send `outgoing` to rank + 1 and receive `incoming` from rank - 1 (both wrap around: the
    last rank's right neighbour is rank 0). Every rank calls this at the same moment, and both
    messages must be under way at once. Return only when `incoming` holds what the left neighbour
    sent and `outgoing` may be changed again. Must work on gloo and on NCCL. (On one rank there is
    no neighbour, and the ring below never calls this: its loops run world_size - 1 = 0 times.)"""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # HINT 1: a blocking send or recv on every rank at once deadlocks: post both operations before waiting on either. NCCL wants a send and a receive that run at the same time posted together, as one group: dist.batch_isend_irecv posts a list of dist.P2POp that way
    # HINT 2: ops = [dist.P2POp(dist.irecv, incoming, left), dist.P2POp(dist.isend, outgoing, right)]; then wait on every request that dist.batch_isend_irecv(ops) returns
    # BEGIN SOLUTION: send `outgoing` to the right neighbour and receive `incoming` from the left one, both in flight at once and posted as one group (the form NCCL requires, chapter 02), and return when both are complete
    # the receive first: gloo posts the ops in list order, and at 2 ranks (left == right, one connection)
    # a send posted before its receive made the ring take 1.5x as long (measured: chapter 04, make cluster-bench)
    ops = [dist.P2POp(dist.irecv, incoming, left), dist.P2POp(dist.isend, outgoing, right)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    # END SOLUTION


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a contiguous `tensor` over all ranks, in place, with a ring; return it.

    Only point-to-point messages: no dist.all_reduce (or any other collective) inside."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor.view(-1), world_size)
    # HINT 1: N-1 steps; at each step every rank sends one chunk right and adds the chunk arriving from the left into its own copy of that chunk. Rank r starts by sending its own chunk r; the chunk it receives is the one its left neighbour sent
    # HINT 2: what arrives must not land in the chunk itself (that would overwrite your part before adding it): receive into a separate buffer, allocated once as large as the largest chunk (torch.empty_like(chunks[0])), and use its first numel elements for a chunk of numel; then add in place
    # HINT 3: at step s rank r sends chunk (r - s) % N and receives chunk (r - s - 1) % N into landing[:chunks[(r - s - 1) % N].numel()], then chunks[(r - s - 1) % N] += that
    # BEGIN SOLUTION: scatter-reduce: after N-1 steps of sending right and receiving from the left, rank r holds the sum over all ranks of chunk (r + 1) % N (the chunks may differ in size by one)
    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once
    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        arrived = landing[:chunks[receive].numel()]
        send_right_receive_left(chunks[send], arrived)
        chunks[receive] += arrived
    # END SOLUTION
    # now rank r holds the full sum of chunk (r + 1) % world_size
    # HINT 1: N-1 more steps; now each rank passes on the finished chunk it got last, starting with the one it reduced, and the received chunk replaces its own copy (no adding)
    # HINT 2: at step s rank r sends chunk (r + 1 - s) % N and receives chunk (r - s) % N straight into chunks[(r - s) % N]
    # BEGIN SOLUTION: all-gather: pass the finished chunks around the ring so that every rank ends with every chunk's sum
    for step in range(world_size - 1):
        send, receive = (rank + 1 - step) % world_size, (rank - step) % world_size
        send_right_receive_left(chunks[send], chunks[receive])
    # END SOLUTION
    return tensor


# --- Your part 2: a home-made DDP -----------------------------------------------------------------


def average_gradients(model: nn.Module) -> None:
    """After backward: replace every parameter's .grad by its mean over all ranks, with one
    ring_all_reduce on one flat buffer of all gradients (what DDP does with its buckets)."""
    world_size = dist.get_world_size()
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen parameters have no gradient
    for p in trained:
        # unused in this forward: zeros, so that every rank sends a buffer of the same layout. (DDP with
        # find_unused_parameters=True counts it as zeros too where another rank used it, but leaves
        # a parameter that no rank used at None; lab 12 does that.)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in trained]
    # HINT 1: torch.cat of the grads reshaped to 1-D makes one flat copy; ring_all_reduce sums it; a sum over N ranks is N times the mean; the copy must go back into each p.grad in place
    # HINT 2: after ring_all_reduce(flat) and flat /= world_size, walk an offset through flat: g.copy_(flat[offset:offset + g.numel()].view_as(g)); offset += g.numel()
    # BEGIN SOLUTION: leave in every p.grad its mean over all ranks, using one ring_all_reduce on one flat buffer
    flat = torch.cat([g.reshape(-1) for g in grads])
    ring_all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    # END SOLUTION


@torch.no_grad()
def broadcast_state(model: nn.Module) -> None:
    """Start every rank from rank 0's parameters and buffers, as DDP does when it wraps a model."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor, src=0)


# --- The training that uses it (given) ------------------------------------------------------------

SEED = 0
BATCH_PER_RANK = 16
STEPS = 8
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def my_batch(data: TensorDataset, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch `step`: consecutive blocks of the data, on `device`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = data.tensors
    start = (step * world_size + rank) * BATCH_PER_RANK
    return x[start:start + BATCH_PER_RANK].to(device), y[start:start + BATCH_PER_RANK].to(device)


def train(model: nn.Module, data: TensorDataset, device: torch.device, by_hand: bool) -> list[tuple]:
    """STEPS of SGD; by_hand: average the gradients with average_gradients (else `model` is a DDP
    and backward averages them). Returns (local gradients, averaged gradients, weights) per step."""
    if by_hand:
        broadcast_state(model)  # what DDP does when it wraps the model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        x, y = my_batch(data, step, device)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        local = flat_grads(model)
        if by_hand:
            average_gradients(model)
        optimizer.step()
        history.append((local, flat_grads(model), flat_params(model)))
    return history


if __name__ == "__main__":  # the check is in checks/lab04.py: you need not read it
    from checks import lab04
    lab04.run(ring_chunks=ring_chunks, send_right_receive_left=send_right_receive_left,
              ring_all_reduce=ring_all_reduce, BATCH_PER_RANK=BATCH_PER_RANK, STEPS=STEPS, make_model=make_model,
              train=train)
