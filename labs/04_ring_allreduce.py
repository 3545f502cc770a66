"""Lab 04 - a ring all-reduce written by hand, then a home-made DDP that averages gradients with it.

Fill in the TODOs in order: split a tensor into chunks, swap chunks with your neighbours, run the
two phases of the ring, then use your ring to average a model's gradients. The check compares
your ring with dist.all_reduce (odd sizes, several dtypes) and your training with DDP, step by step.

Run it with 4 processes:
    make lab CH=04 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/04_ring_allreduce.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/04_ring_allreduce.py; edit that one.)

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
    # (stuck? `make hint CH=04` prints hint 1 of 2; run it again for the next)
    # TODO: return exactly world_size views of consecutive pieces of `flat`, sized as the docstring says
    raise NotImplementedError("the TODO above")


def send_right_receive_left(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
    """Send `outgoing` to rank + 1 and receive `incoming` from rank - 1 (both wrap around: the
    last rank's right neighbour is rank 0). Every rank calls this at the same moment, and both
    messages must be under way at once. Return only when `incoming` holds what the left neighbour
    sent and `outgoing` may be changed again. Must work on gloo and on NCCL. (On one rank there is
    no neighbour, and the ring below never calls this: its loops run world_size - 1 = 0 times.)"""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # (stuck? `make hint CH=04` prints hint 1 of 2; run it again for the next)
    # TODO: send `outgoing` to the right neighbour and receive `incoming` from the left one, both in flight at once and posted as one group (the form NCCL requires, chapter 02), and return when both are complete
    raise NotImplementedError("the TODO above")


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a contiguous `tensor` over all ranks, in place, with a ring; return it.

    Only point-to-point messages: no dist.all_reduce (or any other collective) inside."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor.view(-1), world_size)
    # (stuck? `make hint CH=04` prints hint 1 of 3; run it again for the next)
    # TODO: scatter-reduce: after N-1 steps of sending right and receiving from the left, rank r holds the sum over all ranks of chunk (r + 1) % N (the chunks may differ in size by one)
    raise NotImplementedError("the TODO above")
    # now rank r holds the full sum of chunk (r + 1) % world_size
    # (stuck? `make hint CH=04` prints hint 1 of 2; run it again for the next)
    # TODO: all-gather: pass the finished chunks around the ring so that every rank ends with every chunk's sum
    raise NotImplementedError("the TODO above")
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
    # (stuck? `make hint CH=04` prints hint 1 of 2; run it again for the next)
    # TODO: leave in every p.grad its mean over all ranks, using one ring_all_reduce on one flat buffer
    raise NotImplementedError("the TODO above")


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
