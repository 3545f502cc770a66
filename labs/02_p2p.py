"""Lab 02 - point-to-point: a token passed around the ring, then a non-blocking halo exchange.

Run it with 4 processes:
    make lab CH=02 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/02_p2p.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/02_p2p.py; edit that one.)

from datetime import timedelta

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, print_ranked, run_lab

# Tags tell apart two messages between the same pair of ranks. With 2 ranks, the left and the
# right neighbour are the same process, so the halo going right and the halo going left travel
# between the same two ranks: without tags they could land in each other's buffer.
GOING_RIGHT, GOING_LEFT = 0, 1


# -- part 1: a token around the ring, with blocking send and recv ------------------------------

def pass_token() -> int:
    """Send a token once around the ring 0 -> 1 -> ... -> N-1 -> 0 with blocking send/recv.

    Rank 0 creates the token, an int64 tensor holding 1, and sends it to its right neighbour.
    Every other rank receives it from its left neighbour, appends its own digit
    (token = token * 10 + rank + 1) and sends it on to its right neighbour. Rank 0 finally
    receives it back from rank N-1. Return the value this rank last held: on 4 ranks,
    rank 1 -> 12, rank 2 -> 123, rank 3 -> 1234, and rank 0 -> 1234 (it came back)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO: find your left and right neighbours on the ring (wrap around with %), then rank 0 sends first and receives last while the others receive, append their digit and send on
    raise NotImplementedError("the TODO above")


# -- part 2: a halo exchange with isend/irecv --------------------------------------------------

def start_halo_exchange(local: torch.Tensor, left_halo: torch.Tensor, right_halo: torch.Tensor,
                        width: int) -> list:
    """Start (do not finish) the exchange of halos with both neighbours on a ring.

    This rank's slab `local` is one piece of a long array cut into consecutive slabs, one per
    rank (rank 0 first; the array wraps around, so rank 0's left neighbour is rank N-1).
    Fill `left_halo` with the last `width` elements of the left neighbour's slab and
    `right_halo` with the first `width` elements of the right neighbour's slab; send your own
    edges to them in return. Use dist.isend / dist.irecv (tag=GOING_RIGHT or GOING_LEFT for the
    direction a message travels) and return the requests: the caller waits on them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    # TODO: post two irecv (left_halo from the left, right_halo from the right) and two isend (your first `width` elements to the left, your last `width` to the right), each tagged with the direction it travels; return the four requests
    raise NotImplementedError("the TODO above")


def moving_average(x: torch.Tensor, width: int) -> torch.Tensor:
    """Mean of the 2*width+1 values around each point that has `width` neighbours on each side."""
    n = x.numel() - 2 * width
    return sum(x[k:k + n] for k in range(2 * width + 1)) / (2 * width + 1)


def smooth(local: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One smoothing step of the distributed array: (new slab, left halo, right halo)."""
    left_halo = torch.full((width,), float("nan"), dtype=local.dtype)
    right_halo = torch.full((width,), float("nan"), dtype=local.dtype)
    requests = start_halo_exchange(local, left_halo, right_halo, width)
    out = torch.empty_like(local)
    out[width:-width] = moving_average(local, width)  # needs no neighbour: overlaps the messages
    for request in requests or []:
        request.wait()  # now both halos have arrived (and our edges have left)
    padded = torch.cat([left_halo, local, right_halo])
    out[:width] = moving_average(padded[:3 * width], width)
    out[-width:] = moving_average(padded[-3 * width:], width)
    return out, left_halo, right_halo


# -- the checks --------------------------------------------------------------------------------

def expected_token(rank: int, world_size: int, reverse: bool = False) -> int:
    """The token's digits in the order it visits the ranks (reverse: 0 -> N-1 -> ... -> 1)."""
    order = [0] + (list(range(world_size - 1, 0, -1)) if reverse else list(range(1, world_size)))
    visited = order if rank == 0 else order[:order.index(rank) + 1]
    return int("".join(str(r + 1) for r in visited))


def check_token(checks: Checks, token: int) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = expected_token(rank, world_size)
    if token == expected:
        hint = ""
    elif world_size > 2 and token == expected_token(rank, world_size, reverse=True):
        hint = ("the token went the wrong way round (0 -> N-1 -> ... -> 1): send to "
                "(rank + 1) % world_size and receive from (rank - 1) % world_size")
    elif rank > 0 and token == expected // 10:
        hint = "this rank's digit is missing: append it with token * 10 + rank + 1 before sending on"
    else:
        hint = "each rank receives from its left neighbour, appends rank + 1 as a digit and sends to its right"
    checks.expect(token == expected, f"the token on rank {rank} is {token}, expected {expected}: {hint}")


def slab_of(rank: int, world_size: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slab of the global array: distinct values, so every misplaced element shows."""
    return global_array(world_size, size)[rank * size:(rank + 1) * size]


def global_array(world_size: int, size: int) -> torch.Tensor:
    return torch.arange(world_size * size, dtype=torch.float64) ** 2


def check_halos(checks: Checks, left_halo: torch.Tensor, right_halo: torch.Tensor, size: int,
                width: int) -> None:
    """The halos must be exactly the neighbours' edge values (a copy: no tolerance)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    before = slab_of((rank - 1) % world_size, world_size, size)
    after = slab_of((rank + 1) % world_size, world_size, size)
    want_left, want_right = before[-width:], after[:width]
    ok = torch.equal(left_halo, want_left) and torch.equal(right_halo, want_right)
    if ok:
        hint = ""
    elif torch.isnan(left_halo).any() or torch.isnan(right_halo).any():
        hint = ("a halo was never filled: post an irecv into each halo and return its request, "
                "so that the caller waits for it")
    elif torch.equal(left_halo, want_right) and torch.equal(right_halo, want_left):
        hint = ("the left and right halos are swapped: with 2 ranks both neighbours are the same "
                "rank, so the two directions need different tags (GOING_RIGHT / GOING_LEFT); "
                "or each edge went to the wrong side (first elements go left, last go right)")
    elif torch.equal(left_halo, before[:width]) or torch.equal(right_halo, after[-width:]):
        hint = ("you sent the wrong edge: your first `width` elements go to the left neighbour, "
                "your last `width` elements to the right neighbour")
    elif torch.equal(left_halo, before[-width - 1:-1]) or torch.equal(right_halo, after[1:width + 1]):
        hint = "the halo is shifted by one element (off by one): send local[:width] and local[-width:]"
    else:
        hint = "compare your slices and neighbours with the docstring of start_halo_exchange"
    checks.expect(ok, f"rank {rank}: halos {left_halo.tolist()} | {right_halo.tolist()}, expected "
                      f"{want_left.tolist()} | {want_right.tolist()}: {hint}")


def check_smoothing(checks: Checks, smoothed: torch.Tensor, size: int, width: int) -> None:
    """Against the same moving average computed on the whole array in one process (roll wraps it).
    Tolerance 1e-12 (float64): the same sums in the same order; only a wrong halo can differ."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole = global_array(world_size, size)
    padded = torch.cat([whole[-width:], whole, whole[:width]])
    reference = moving_average(padded, width)[rank * size:(rank + 1) * size]
    error = (smoothed - reference).abs().max().item()
    checks.expect(error <= 1e-12, f"rank {rank}: the smoothed slab differs from a single-process "
                                  f"run by {error:.3g}: the halos it used were wrong (see above)")


def main(me: Rank, checks: Checks) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    token = pass_token()
    print_ranked(f"token {token}")
    check_token(checks, token)

    size, width = 7, 2  # an odd slab size: a halo of 2 on each side
    local = slab_of(rank, world_size, size)
    smoothed, left_halo, right_halo = smooth(local, width)
    print_ranked(f"halos {left_halo.tolist()} | {right_halo.tolist()}")
    check_halos(checks, left_halo, right_halo, size, width)
    check_smoothing(checks, smoothed, size, width)
    print0(f"smoothed {world_size} slabs of {size} with a halo of {width}")


# A short timeout: a send/recv that no rank matches fails in 10 s as a likely deadlock.
if __name__ == "__main__":
    run_lab(main, title="Lab 02 (p2p)", world_sizes=range(2, 10), timeout=timedelta(seconds=10))
