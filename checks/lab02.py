"""The check of lab 02 (p2p): it runs the code of labs/02_p2p.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, print_ranked, run_lab
from ringside.calls import DryRun, Recorded, Recorder
from ringside.effects import device_problem, never_waited, passed_on_every_rank, rank_gpu, unwaited_diagnosis

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------

def rehearse(function, *args) -> list:
    """Every rank's planned calls in function(*args): [(kind, peer, dtype, numel, device), ...] per
    rank. A rank whose rehearsal raised re-raises here (after the others heard of it), so the error
    and its line reach the report."""
    error = None
    with DryRun() as calls:  # the calls are noted, nothing is sent: nothing can block
        try:
            function(*args)
        except Exception as raised:  # an open TODO or a crash: the others must not wait for this rank
            error = raised
    mine = [(op["kind"], op["peer"] if op["peer"] is None or isinstance(op["peer"], int) else str(op["peer"]),
             str(op["tensor"].dtype).removeprefix("torch."), op["tensor"].numel(), op["tensor"].device.type)
            for op in calls.ops]
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(plans, (mine, error is not None))
    if error is not None:
        raise error
    crashed = [rank for rank, (_, failed) in enumerate(plans) if failed]
    if crashed:
        raise RuntimeError(f"{function.__name__} raised an error on rank {crashed[0]} (that rank's line says which)")
    return [ops for ops, _ in plans]


def token_plan_mistakes(plans: list, device: torch.device) -> list[str]:
    """What the planned calls of pass_token show, before any of them runs: a peer that does not
    exist, a token that is not an integer, a send nobody receives, a wait that never ends."""
    world_size, found = len(plans), []
    for rank, ops in enumerate(plans):
        for kind, peer, dtype, numel, where in ops:
            verb = "sends the token to" if "send" in kind else "receives the token from"
            side, step = ("right", 1) if "send" in kind else ("left", -1)
            neighbour = (rank + step) % world_size
            if peer is None:
                found.append(f"rank {rank} receives without src: name the sender, its left neighbour (NCCL has "
                             f"no receive from any source)")
            elif not isinstance(peer, int) or not 0 <= peer < world_size:
                found.append(f"rank {rank} {verb} rank {peer}, which does not exist (ranks 0-{world_size - 1}): "
                             f"the ring wraps around - rank {rank}'s {side} neighbour is rank {neighbour}, "
                             f"(rank {'+' if side == 'right' else '-'} 1) % world_size")
            elif peer == rank:
                found.append(f"rank {rank} {verb} itself: its neighbours are ranks {(rank - 1) % world_size} "
                             f"(left) and {(rank + 1) % world_size} (right)")
            if where != device.type:
                found.append(f"rank {rank}'s token is on {where}, but this group's device is {device}: "
                             f"create it on `device`")
    dtypes = sorted({op[2] for ops in plans for op in ops})
    for dtype in dtypes:
        kind = getattr(torch, dtype)
        longest = expected_token(0, 9)  # the largest token of any run (9 ranks)
        if kind.is_floating_point:
            exact = int(2 / torch.finfo(kind).eps)  # whole numbers up to 2**(mantissa bits + 1) are exact
            rounded = int(torch.tensor(longest, dtype=kind).item()) if exact < longest else longest
            found.append(f"the token is a {dtype} tensor, but a token is an integer: " + (
                f"{dtype} holds whole numbers exactly only up to {exact} (2**{exact.bit_length() - 1}), so on 9 "
                f"ranks {longest} arrives as {rounded} - use an integer dtype (torch.int64)" if exact < longest else
                f"{dtype} happens to hold 9 digits, but use an integer dtype (torch.int64)"))
        elif kind.is_complex or kind == torch.bool:
            found.append(f"the token is a {dtype} tensor, but a token is an integer: use torch.int64")
        elif torch.iinfo(kind).max < longest:
            found.append(f"the token is a {dtype} tensor: it holds at most {torch.iinfo(kind).max}, and the token "
                         f"of 9 ranks is {longest} - use torch.int64")
    if found or any(op[0] not in ("send", "recv") for ops in plans for op in ops):
        return list(dict.fromkeys(found))  # isend/irecv: no simulation of blocking calls below
    # Play the blocking calls: a send and the recv it is meant for complete together (on gloo a
    # send waits for its recv); whatever is left when nothing can move would wait for ever.
    done, moved = [0] * world_size, True
    while moved:
        moved = False
        for rank, ops in enumerate(plans):
            if done[rank] < len(ops) and ops[done[rank]][0] == "send":
                peer = ops[done[rank]][1]
                if done[peer] < len(plans[peer]) and plans[peer][done[peer]][:2] == ("recv", rank):
                    sent, received = ops[done[rank]], plans[peer][done[peer]]
                    if sent[2:4] != received[2:4]:
                        found.append(f"rank {rank} sends a {sent[2]} tensor of {sent[3]} element(s), and rank {peer} "
                                     f"receives it into a {received[2]} tensor of {received[3]}: only bytes travel, "
                                     f"so the receiver must allocate the same shape and dtype")
                    done[rank], done[peer], moved = done[rank] + 1, done[peer] + 1, True
    stuck = [rank for rank in range(world_size) if done[rank] < len(plans[rank])]
    if not stuck:
        return found
    waits = {rank: plans[rank][done[rank]][:2] for rank in stuck}
    for rank, (kind, peer) in waits.items():
        if peer not in waits:  # the peer finished: nothing will ever match this call
            did = "sending to" if kind == "recv" else "receiving from"
            act = "receive the token from" if kind == "recv" else "send the token to"
            found.append(f"rank {rank} would wait for ever to {act} rank {peer}, which finished without {did} "
                         f"rank {rank}" + (
                             f": the last rank (rank {peer}) must send the token on to rank 0 - that closes the ring"
                             if (rank, kind, peer) == (0, "recv", world_size - 1) else
                             f": rank {rank} receives from its left neighbour, rank {(rank - 1) % world_size}"
                             if kind == "recv" and peer != (rank - 1) % world_size else
                             f": rank {rank} sends to its right neighbour, rank {(rank + 1) % world_size}"
                             if kind == "send" and peer != (rank + 1) % world_size else ""))
    if not found:
        kinds = {kind for kind, _ in waits.values()}
        what = ("all wait in recv and none of them sends: likely a deadlock - rank 0 starts with the token, so it "
                "must send first and receive it back last" if kinds == {"recv"} else
                "all wait in send, each for a neighbour that is sending too (on gloo a send waits for its recv): "
                "likely a deadlock - only rank 0 sends first; every other rank receives first" if kinds == {"send"} else
                "wait for each other (likely a deadlock): " + "; ".join(
                    f"rank {rank} in {kind} with rank {peer}" for rank, (kind, peer) in waits.items()))
        found.append(f"{'ranks ' + ', '.join(map(str, stuck)) if len(stuck) > 1 else 'rank ' + str(stuck[0])} {what}")
    return list(dict.fromkeys(found))


def halo_plan_mistakes(plans: list, width: int) -> list[str]:
    """What the planned calls of start_halo_exchange on all ranks show before any of them runs: a
    peer that does not exist, a blocking call, a message of another size than a halo (gloo aborts the
    receiving process on it), or a message that no receive matches."""
    world_size, found = len(plans), []
    for rank, ops in enumerate(plans):
        for kind, peer, _, numel, _ in ops:
            if "send" in kind and numel != width:
                found.append(f"with halos of width={width}, start_halo_exchange on rank {rank} sends {numel} "
                             f"elements: a halo holds `width` of them - send local[:width] and local[-width:]")
            verb = "sends to" if "send" in kind else "receives from"
            if peer is None:
                found.append("start_halo_exchange receives without src: name the neighbour (NCCL has no receive "
                             "from any source)")
            elif not isinstance(peer, int) or not 0 <= peer < world_size:
                found.append(f"start_halo_exchange on rank {rank} {verb} rank {peer}, which does not exist (ranks "
                             f"0-{world_size - 1}): the ring wraps around - the neighbours are (rank - 1) % "
                             f"world_size and (rank + 1) % world_size")
            elif kind in ("send", "recv"):
                found.append("start_halo_exchange used a blocking send or recv: it must only start the messages "
                             "(isend/irecv in dist.batch_isend_irecv) and return at once")
    if found:
        return list(dict.fromkeys(found))
    count = {}  # (sender, receiver) -> [messages sent, receives posted]
    for rank, ops in enumerate(plans):
        for kind, peer, *_ in ops:
            pair = (rank, peer) if "send" in kind else (peer, rank)
            count.setdefault(pair, [0, 0])["recv" in kind] += 1
    unmatched = [(pair, n) for pair, n in sorted(count.items()) if n[0] != n[1]]
    if unmatched:
        (sender, receiver), (sent, posted) = unmatched[0]
        found.append(f"rank {sender} sends {sent} message(s) to rank {receiver}, which posts {posted} receive(s) "
                     f"from it" + (f" (and {len(unmatched) - 1} more pairs of ranks disagree)" if len(unmatched) > 1
                                   else "") + ": the exchange would wait for ever - each rank sends one edge to "
                     "each neighbour and receives one halo from each, left_halo from the left, right_halo from "
                     "the right")
    return found


def halo_mistakes(calls: Recorder, returned, local, width: int, left_halo, right_halo) -> list[str]:
    """What the recorded calls of start_halo_exchange show, whatever the halos came out as."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    ops, found = calls.ops, []
    sends = [op for op in ops if "send" in op["kind"]]
    recvs = [op for op in ops if "recv" in op["kind"]]
    tags = sorted({op["tag"] for op in ops if op["tag"]})
    if tags:
        found.append(f"start_halo_exchange passed tag={tags[0]}: NCCL ignores tags (only gloo honours them) - "
                     f"between two ranks, messages match in the order they are posted: post the receives "
                     f"in the order the other rank posts the sends they must match")
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
        said = [f"receives from ranks {[op['peer'] for op in recvs]}"] if \
            sorted(op["peer"] for op in recvs) != sorted([left, right]) else []
        said += [f"sends to ranks {[op['peer'] for op in sends]}"] if \
            sorted(op["peer"] for op in sends) != sorted([left, right]) else []
        names = {left_halo.data_ptr(): ("left_halo", left), right_halo.data_ptr(): ("right_halo", right)}
        said += [f"{names[op['ptr']][0]} must come from rank {names[op['ptr']][1]}" for op in recvs
                 if op["ptr"] in names and op["peer"] != names[op["ptr"]][1]]
        found.append(f"start_halo_exchange {', '.join(said)}: it sends one edge to and receives one halo from "
                     f"each neighbour, rank {left} (left) and rank {right} (right)")
    elif {op["ptr"] for op in recvs} != {left_halo.data_ptr(), right_halo.data_ptr()}:
        found.append("start_halo_exchange did not receive into left_halo and right_halo themselves - "
                     "irecv into the tensors the caller gave (a new tensor never reaches the caller)")
    elif world_size > 2:  # two different neighbours: each call's peer must match its buffer
        source = {op["ptr"]: op["peer"] for op in recvs}
        if (source[left_halo.data_ptr()], source[right_halo.data_ptr()]) == (right, left):
            found.append("start_halo_exchange receives left_halo from the right neighbour and right_halo from "
                         "the left: the receives are crossed - left_halo is the left neighbour's last elements, "
                         "so it comes from rank (rank - 1) % world_size")
        first = [op["peer"] for op in sends if torch.equal(op["tensor"], local[:width])]
        last = [op["peer"] for op in sends if torch.equal(op["tensor"], local[-width:])]
        if first == [right] and last == [left]:
            found.append(f"start_halo_exchange sends the first {width} elements to the right neighbour and the "
                         f"last {width} to the left: you sent the wrong edge - the first elements are the left "
                         f"neighbour's right halo, so they go left")
        # At 2 ranks both neighbours are one process and its k-th send meets the other's k-th receive:
        # posted in this order there, the last edge must meet left_halo (the docstring asks for 2 ranks).
        edges = ["last" if torch.equal(op["tensor"], local[-width:]) else "first" for op in sends]
        halos = ["left" if op["ptr"] == left_halo.data_ptr() else "right" for op in recvs]
        if not found and any((edge == "last") != (halo == "left") for edge, halo in zip(edges, halos)):
            found.append(f"start_halo_exchange posts its sends in the order {edges} edge and its receives "
                         f"{halos}_halo: right here, but at 2 ranks (which the docstring asks for) both neighbours "
                         f"are one process and messages between a pair match in the order posted, so the halos "
                         f"would come swapped - post each send in the same place as the receive it must meet")
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
        hint = "this rank's digit is missing: append it (rank + 1) after receiving, before sending on"
    elif str(token) == "1" + "".join(str(r) for r in range(1, int(str(expected)[-1]))):
        hint = "each rank appended its rank, not rank + 1, as its digit"
    elif rank == 0 and str(token).startswith(str(expected)) and token != expected:
        hint = "rank 0 appended a digit of its own when the token came back: it only receives it"
    else:
        hint = "each rank receives from its left neighbour, appends rank + 1 as a digit and sends to its right"
    checks.expect(token == expected, f"the token is {token}, expected {expected}: {hint}")


def slab_of(rank: int, world_size: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slab of the global array: distinct values, so every misplaced element shows."""
    return global_array(world_size, size)[rank * size:(rank + 1) * size]


def global_array(world_size: int, size: int) -> torch.Tensor:
    return torch.arange(world_size * size, dtype=torch.float64) ** 2


def check_halos(checks: Checks, left_halo: torch.Tensor, right_halo: torch.Tensor, size: int,
                width: int) -> bool:
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
            "order they are posted - left_halo's receive was matched with the other rank's first elements; "
            "post the receives in the order the other rank posts the sends they must match" if world_size == 2 else
            ": left_halo holds the right neighbour's first elements - the receives are crossed (left_halo "
            "comes from the left neighbour, right_halo from the right)"))
    elif world_size > 2 and torch.equal(left_halo, after[-width:]) and torch.equal(right_halo, before[:width]):
        hint = ("left_halo holds the right neighbour's last elements: both the sends and the receives go to "
                "the wrong side (first elements go left, left_halo comes from the left)")
    elif torch.equal(left_halo, before[:width]) or torch.equal(right_halo, after[-width:]):
        hint = ("you sent the wrong edge: your first `width` elements go to the left neighbour, "
                "your last `width` elements to the right neighbour")
    elif torch.equal(left_halo, before[-width - 1:-1]) or torch.equal(right_halo, after[1:width + 1]):
        hint = "the halo is shifted by one element (off by one): send local[:width] and local[-width:]"
    else:
        hint = "compare your slices and neighbours with the docstring of start_halo_exchange"
    return checks.expect(ok, f"halos {left_halo.tolist()} | {right_halo.tolist()}, expected "
                             f"{want_left.tolist()} | {want_right.tolist()}: {hint}")


def check_smoothing(checks: Checks, smoothed: torch.Tensor, size: int, width: int) -> None:
    """Against the same moving average computed on the whole array in one process (roll wraps it).
    Tolerance 1e-12 (float64): the same sums in the same order; only a wrong halo can differ."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole = global_array(world_size, size)
    padded = torch.cat([whole[-width:], whole, whole[:width]])
    reference = lab.moving_average(padded, width)[rank * size:(rank + 1) * size]
    error = (smoothed.cpu() - reference).abs().max().item()
    checks.expect(error <= 1e-12, f"the smoothed slab differs from a single-process run by {error:.3g}, "
                                  f"though the halos are right: did start_halo_exchange write into `local`?")


def main(me: Rank, checks: Checks) -> None:
    # pass_token runs twice: first on paper (nothing sent), so a call that would wait for ever is
    # named at once, then for real, if the plan can complete.
    token_mistakes = token_plan_mistakes(rehearse(lab.pass_token, me.device), me.device)
    for mistake in token_mistakes:
        checks.fail(mistake)
    if not token_mistakes:
        token = lab.pass_token(me.device)
        print_ranked(f"token {token}")
        check_token(checks, token)

    # An odd slab size and a halo of 2, then the other widths the contract allows (1, and 3 on a slab of 8).
    for size, width in ((7, 2), (5, 1), (8, 3)):
        if not halo_case(me, checks, size, width, show=width == 2) or checks.failures:
            return
    if passed_on_every_rank(checks):
        check_on_gpu(me, checks)


def check_on_gpu(me: Rank, checks: Checks) -> None:
    """pass_token and one smoothing step once more as `make lab` runs them on a GPU machine: `device`
    this rank's stand-in GPU, NCCL's rules for what send and recv accept (ringside.effects.rank_gpu).
    A token or a buffer made on the CPU is named where it is made."""
    with rank_gpu(lab.pass_token, lab.start_halo_exchange, lab.smooth) as (gpu, _):
        plans, problem = device_problem("pass_token", rehearse, lab.pass_token, gpu.device)
        mistakes = token_plan_mistakes(plans, gpu.device) if problem is None else [problem]
        if mistakes:
            checks.fail(mistakes[0])
            return
        token, problem = device_problem("pass_token", lab.pass_token, gpu.device)
        if problem is None:
            check_token(checks, token)
            _, problem = device_problem("start_halo_exchange (in smooth)", halo_case, me, checks, 7, 2, False,
                                        gpu.device)
        checks.expect(problem is None, problem or "")


def halo_case(me: Rank, checks: Checks, size: int, width: int, show: bool, device: torch.device | None = None) -> bool:
    """One smoothing step with start_halo_exchange on slabs of `size` and halos of `width` (on `device`,
    the rank's by default): the halos, the smoothed slab, and the caller's slab left as it was. False
    where something was wrong."""
    device = device or me.device
    local = slab_of(me.rank, me.world_size, size).to(device)
    # start_halo_exchange too runs on paper first: messages that nobody receives are named at once.
    halos = [torch.zeros(width, dtype=local.dtype, device=device) for _ in range(2)]
    planned = halo_plan_mistakes(rehearse(lab.start_halo_exchange, local.clone(), *halos, width), width)
    for mistake in planned:
        checks.fail(f"(slabs of {size}, halos of {width}) {mistake}" if not show else mistake)
    if planned:
        return False
    calls, seen = Recorder(), {}

    def watched_exchange(local, left_halo, right_halo, width):  # the check watches the calls it makes
        with calls:
            seen["returned"] = lab.start_halo_exchange(local, left_halo, right_halo, width)
        seen["mistakes"] = halo_mistakes(calls, seen["returned"], local, width, left_halo, right_halo)
        return seen["returned"]

    original = local.clone()
    try:
        smoothed, left_halo, right_halo = lab.smooth(local, width, watched_exchange)
    except RuntimeError as error:  # a wait that timed out: say what the calls showed
        if "mistakes" not in seen or "timed out" not in str(error).lower() and "closed" not in str(error).lower():
            raise
        return checks.expect(False, "the halo exchange never finished (a wait timed out: likely a deadlock, or a neighbour "
                                    "stopped - see the other ranks' lines)"
                                    + (" - " + "; ".join(seen["mistakes"]) if seen["mistakes"] else ""))
    for mistake in seen["mistakes"]:
        checks.fail(mistake)
    if never_waited(calls.calls):  # read before they arrived: named above, the values say nothing more
        if not seen["mistakes"]:
            checks.fail(unwaited_diagnosis("the halo exchange", calls.calls))
        return False
    if show:
        print_ranked(f"halos {left_halo.tolist()} | {right_halo.tolist()}")
    ok = check_halos(checks, left_halo, right_halo, size, width)
    ok = checks.expect(torch.equal(local, original),
                       f"with halos of {width}, the caller's slab `local` changed during the exchange: send copies "
                       f"of its edges (local[:width].clone()), never write into it") and ok
    if ok:  # wrong halos: the smoothing is wrong too
        check_smoothing(checks, smoothed, size, width)
    if show:
        print0(f"smoothed {me.world_size} slabs of {size} with a halo of {width}")
    return ok


# A short timeout: a send/recv that no rank matches fails in 10 s as a likely deadlock.


def ring_of(world_size: int) -> str | None:
    """A ring needs a neighbour; the token keeps one decimal digit per rank."""
    if world_size == 1:
        return ("a ring of one rank has no neighbour to send to (gloo and NCCL refuse a message to oneself): "
                "use --nproc-per-node 2 or more")
    if world_size > 9:
        return "the token appends one decimal digit per rank, 1 to 9: use --nproc-per-node 2 to 9"
    return None


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 02 (p2p)", refuse=ring_of, timeout=timedelta(seconds=10))
