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
from ringside.calls import Recorded, Recorder

# This lab runs on gloo (CPU) and on NCCL (GPUs) alike, so it keeps NCCL's rules: every recv names
# its sender, no message relies on a `tag` (NCCL ignores tags; gloo alone honours them), and sends
# and receives that run at the same time are posted together with dist.batch_isend_irecv.


# --- Part 1: a token around the ring, with blocking send and recv ---------------------------------

def pass_token(device: torch.device) -> int:
    """Send a token once around the ring 0 -> 1 -> ... -> N-1 -> 0 with blocking send/recv.

    Rank 0 creates the token, an int64 tensor on `device` holding 1, and sends it to its right
    neighbour. Every other rank receives it from its left neighbour, appends its own digit
    (token = token * 10 + rank + 1) and sends it on to its right neighbour. Rank 0 finally
    receives it back from rank N-1. Return the value this rank last held: on 4 ranks,
    rank 1 -> 12, rank 2 -> 123, rank 3 -> 1234, and rank 0 -> 1234 (it came back)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # (stuck? `make hint CH=02` prints hint 1 of 2; run it again for the next)
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


# --- The checks -----------------------------------------------------------------------------------

def halo_mistakes(calls: Recorder, returned, width: int, left_halo, right_halo) -> list[str]:
    """What the recorded calls of start_halo_exchange show, whatever the halos came out as."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    ops, found = calls.ops, []
    sends = [op for op in ops if "send" in op["kind"]]
    recvs = [op for op in ops if "recv" in op["kind"]]
    tags = sorted({op["tag"] for op in ops if op["tag"]})
    if tags:
        found.append(f"start_halo_exchange passed tag={tags[0]}: NCCL ignores tags (only gloo honours them) - "
                     f"between two ranks, messages match in the order they are posted: post what travels "
                     f"right before what travels left, on every rank")
    if any(op["peer"] is None for op in recvs):
        found.append("start_halo_exchange received without src: name the neighbour (NCCL has no receive "
                     "from any source)")
    if any(op["kind"] in ("send", "recv") for op in ops):
        found.append("start_halo_exchange used a blocking send or recv: it must only start the messages "
                     "(isend/irecv in dist.batch_isend_irecv) and return at once")
    elif any(not op["batch"] for op in ops):
        found.append("start_halo_exchange posted isend/irecv one by one: that works on gloo, but sends and "
                     "receives that run at once must be posted together with dist.batch_isend_irecv for NCCL")
    if len(sends) != 2 or len(recvs) != 2:
        found.append(f"start_halo_exchange posted {len(sends)} sends and {len(recvs)} receives: one edge to each "
                     f"neighbour and one halo from each, so 2 and 2")
    elif sorted(op["peer"] for op in sends) != sorted([left, right]) or \
            sorted(op["peer"] for op in recvs) != sorted([left, right]):
        found.append(f"start_halo_exchange talked to ranks {sorted({op['peer'] for op in ops})}; the "
                     f"neighbours are {left} (left) and {right} (right)")
    elif {op["ptr"] for op in recvs} != {left_halo.data_ptr(), right_halo.data_ptr()}:
        found.append("start_halo_exchange did not receive into left_halo and right_halo themselves - "
                     "irecv into the tensors the caller gave (a new tensor never reaches the caller)")
    if any(op["waited"] and "i" in op["kind"] for op in ops):
        found.append("start_halo_exchange waited for its requests before returning: then nothing overlaps - "
                     "return the requests unwaited; the caller computes the interior, then waits")
    covered = {id(op) for request in (returned or []) if isinstance(request, Recorded) for op in request.ops}
    missed = [op["kind"] for op in ops if op["kind"] in ("isend", "irecv") and id(op) not in covered]
    if missed and not any(op["waited"] for op in ops):
        found.append(f"start_halo_exchange did not return the requests of its {' and '.join(sorted(set(missed)))}s: "
                     f"return all four, so the caller waits until the halos arrived and the edges left")
    return found


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
    elif rank == 0 and token == 1:
        hint = f"rank 0 must receive the token back from rank {world_size - 1} at the end, into the token it returns"
    elif rank > 0 and token == expected // 10:
        hint = "this rank's digit is missing: append it with token * 10 + rank + 1 before sending on"
    else:
        hint = "each rank receives from its left neighbour, appends rank + 1 as a digit and sends to its right"
    checks.expect(token == expected, f"the token is {token}, expected {expected}: {hint}")


def slab_of(rank: int, world_size: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slab of the global array: distinct values, so every misplaced element shows."""
    return global_array(world_size, size)[rank * size:(rank + 1) * size]


def global_array(world_size: int, size: int) -> torch.Tensor:
    return torch.arange(world_size * size, dtype=torch.float64) ** 2


def check_halos(checks: Checks, left_halo: torch.Tensor, right_halo: torch.Tensor, size: int,
                width: int) -> None:
    """The halos must be exactly the neighbours' edge values (a copy: no tolerance)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left_halo, right_halo = left_halo.cpu(), right_halo.cpu()
    before = slab_of((rank - 1) % world_size, world_size, size)
    after = slab_of((rank + 1) % world_size, world_size, size)
    want_left, want_right = before[-width:], after[:width]
    ok = torch.equal(left_halo, want_left) and torch.equal(right_halo, want_right)
    if ok:
        hint = ""
    elif torch.isnan(left_halo).any() or torch.isnan(right_halo).any():
        hint = ("a halo was never filled: receive into left_halo and right_halo themselves and return "
                "the requests, so that the caller waits for them")
    elif torch.equal(left_halo, want_right) and torch.equal(right_halo, want_left):
        hint = ("the left and right halos are swapped" + (
            ": at 2 ranks both neighbours are one process, and the two messages between you match in the "
            "order they are posted - post what travels right (your last elements, and left_halo's receive) "
            "before what travels left, on every rank" if world_size == 2 else
            ": each edge went to the wrong side (first elements go left, last go right)"))
    elif torch.equal(left_halo, before[:width]) or torch.equal(right_halo, after[-width:]):
        hint = ("you sent the wrong edge: your first `width` elements go to the left neighbour, "
                "your last `width` elements to the right neighbour")
    elif torch.equal(left_halo, before[-width - 1:-1]) or torch.equal(right_halo, after[1:width + 1]):
        hint = "the halo is shifted by one element (off by one): send local[:width] and local[-width:]"
    else:
        hint = "compare your slices and neighbours with the docstring of start_halo_exchange"
    checks.expect(ok, f"halos {left_halo.tolist()} | {right_halo.tolist()}, expected "
                      f"{want_left.tolist()} | {want_right.tolist()}: {hint}")


def check_smoothing(checks: Checks, smoothed: torch.Tensor, size: int, width: int) -> None:
    """Against the same moving average computed on the whole array in one process (roll wraps it).
    Tolerance 1e-12 (float64): the same sums in the same order; only a wrong halo can differ."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole = global_array(world_size, size)
    padded = torch.cat([whole[-width:], whole, whole[:width]])
    reference = moving_average(padded, width)[rank * size:(rank + 1) * size]
    error = (smoothed.cpu() - reference).abs().max().item()
    checks.expect(error <= 1e-12, f"the smoothed slab differs from a single-process "
                                  f"run by {error:.3g}: the halos it used were wrong (see above)")


def main(me: Rank, checks: Checks) -> None:
    token = pass_token(me.device)
    print_ranked(f"token {token}")
    check_token(checks, token)

    size, width = 7, 2  # an odd slab size: a halo of 2 on each side
    local = slab_of(me.rank, me.world_size, size).to(me.device)
    calls, seen = Recorder(), {}

    def watched_exchange(local, left_halo, right_halo, width):  # the check watches the calls it makes
        with calls:
            seen["returned"] = start_halo_exchange(local, left_halo, right_halo, width)
        seen["mistakes"] = halo_mistakes(calls, seen["returned"], width, left_halo, right_halo)
        return seen["returned"]

    try:
        smoothed, left_halo, right_halo = smooth(local, width, watched_exchange)
    except RuntimeError as error:  # a wait that timed out: say what the calls showed
        if "mistakes" not in seen or "timed out" not in str(error).lower() and "closed" not in str(error).lower():
            raise
        checks.fail("the halo exchange never finished (a wait timed out: likely a deadlock)"
                    + (" - " + "; ".join(seen["mistakes"]) if seen["mistakes"] else ""))
        return
    for mistake in seen["mistakes"]:
        checks.fail(mistake)
    print_ranked(f"halos {left_halo.tolist()} | {right_halo.tolist()}")
    check_halos(checks, left_halo, right_halo, size, width)
    check_smoothing(checks, smoothed, size, width)
    print0(f"smoothed {me.world_size} slabs of {size} with a halo of {width}")


# A short timeout: a send/recv that no rank matches fails in 10 s as a likely deadlock.
if __name__ == "__main__":
    run_lab(main, title="Lab 02 (p2p)", world_sizes=range(2, 10), timeout=timedelta(seconds=10))
