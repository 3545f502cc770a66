"""Lab 02 - point-to-point: a token passed around the ring, then a non-blocking halo exchange.

Run it with 4 processes:
    make lab CH=02 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/02_p2p.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/02_p2p.py; edit that one.)

import torch
import torch.distributed as dist

# This lab runs on gloo (CPU) and on NCCL (GPUs) alike, so it keeps NCCL's three rules (chapter 02,
# "Portable or not?"): every recv names its sender, no message relies on a `tag`, and sends and
# receives that run at the same time are grouped as NCCL requires (section 4).


# --- Part 1: a token around the ring, with blocking send and recv ---------------------------------

def pass_token(device: torch.device) -> int:
    """Pass a token once around the ring 0 -> 1 -> ... -> N-1 -> 0 with blocking send/recv.

    The token is a one-element integer tensor on `device` (all 9 digits of 9 ranks must survive).
    It starts at rank 0 with the value 1; each other rank, when the token reaches it, appends its
    own digit rank + 1, and the last rank hands it back to rank 0. Each rank talks to its two ring
    neighbours only. Return the value this rank holds last, as an int: on 4 ranks rank 1 -> 12,
    rank 2 -> 123, rank 3 -> 1234, and rank 0 -> 1234 (it came back)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # (stuck? `make hint CH=02` prints hint 1 of 3; run it again for the next)
    # TODO: pass the token once around the ring as the docstring says, and return the value this rank ends with
    raise NotImplementedError("the TODO above")


# --- Part 2: a halo exchange with non-blocking point-to-point -------------------------------------

def start_halo_exchange(local: torch.Tensor, left_halo: torch.Tensor, right_halo: torch.Tensor,
                        width: int) -> list:
    """Start (do not finish) the exchange of halos with both neighbours on a ring.

    This rank's slab `local` is one piece of a long array cut into consecutive slabs, one per
    rank (rank 0 first; the array wraps around, so rank 0's left neighbour is rank N-1).
    Fill `left_halo` with the last `width` elements of the left neighbour's slab and
    `right_halo` with the first `width` elements of the right neighbour's slab; send your own
    edges to them in return. Return the requests of all four messages without waiting on them:
    the caller computes the interior meanwhile, then waits. It must be right at 2 ranks (where
    the left and the right neighbour are the same process) and on NCCL (no tags)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    # (stuck? `make hint CH=02` prints hint 1 of 2; run it again for the next)
    # TODO: post the four messages (two edges out, two halos in) without waiting, and return their requests
    raise NotImplementedError("the TODO above")


def moving_average(x: torch.Tensor, width: int) -> torch.Tensor:
    """Mean of the 2*width+1 values around each point that has `width` neighbours on each side."""
    n = x.numel() - 2 * width
    return sum(x[k:k + n] for k in range(2 * width + 1)) / (2 * width + 1)


def smooth(local: torch.Tensor, width: int,
           exchange=start_halo_exchange) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One smoothing step of the distributed array: (new slab, left halo, right halo).
    `exchange` is start_halo_exchange (the check passes one that also watches its calls)."""
    left_halo = torch.full((width,), float("nan"), dtype=local.dtype, device=local.device)
    right_halo = torch.full((width,), float("nan"), dtype=local.dtype, device=local.device)
    requests = exchange(local, left_halo, right_halo, width)
    out = torch.empty_like(local)
    out[width:-width] = moving_average(local, width)  # needs no neighbour: overlaps the messages
    for request in requests or []:
        request.wait()  # now both halos have arrived (and our edges have left)
    padded = torch.cat([left_halo, local, right_halo])
    out[:width] = moving_average(padded[:3 * width], width)
    out[-width:] = moving_average(padded[-3 * width:], width)
    return out, left_halo, right_halo


if __name__ == "__main__":  # the check is in checks/lab02.py: you need not read it
    from checks import lab02
    lab02.run(pass_token=pass_token, start_halo_exchange=start_halo_exchange, moving_average=moving_average,
              smooth=smooth)
