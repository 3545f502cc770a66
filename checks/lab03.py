"""The check of lab 03 (collectives): it runs the code of labs/03_collectives.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import COLLECTIVES as RECORDED
from ringside.calls import Recorder, lab_namespaces
from ringside.effects import device_problem, narrowed, passed_on_every_rank, rank_gpu, unwaited_diagnosis
from ringside.lab import ranks_count
from ringside.standin import DeviceMismatch

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks: the same inputs through your function and through torch.distributed's own --------

SHAPES = [(5,), (3, 7), (2, 3, 5)]  # odd sizes: nothing divides evenly
DTYPES = [torch.float32, torch.int64, torch.float64]
SENTINEL = -1  # fills every output before the call: a slot still holding it was never written
COLLECTIVES = tuple(name for name in RECORDED if name != "barrier")  # the lab uses send and recv only


def rank_tensor(rank: int, shape: tuple, dtype: torch.dtype, case: int, device: torch.device) -> torch.Tensor:
    """Each rank's own input: seeded, different on every rank and in every case, never SENTINEL."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    values = torch.randint(0, 100, shape, generator=g).to(dtype) + 1000 * rank + 1
    # float64 with low bits and int64 past 2**24, which float32 cannot hold: a dtype not kept shows
    if dtype == torch.int64:
        values = values * 2 ** 30 + 1
    return (values + (1 / 3 if dtype == torch.float64 else 0)).to(device)


def who_holds(t: torch.Tensor, inputs: list[torch.Tensor]) -> str:
    """Name the tensor `t` turned out to be: a rank's input, the sentinel, or something else."""
    for r, x in enumerate(inputs):
        if torch.equal(t, x):
            return f"rank {r}'s tensor"
    if (t == SENTINEL).all():
        return "nothing (never written)"
    for r, x in enumerate(inputs):
        through = narrowed(t.cpu(), x.cpu())
        if through is not None:
            return (f"rank {r}'s tensor rounded to {str(through)[6:]} (a {str(x.dtype)[6:]} tensor must travel as "
                    f"it is: send and receive the caller's tensor, in its own dtype)")
    return "values that are no rank's tensor"


def fail_once(checks: Checks, diagnosis: str) -> None:
    """The same mistake seen at every root or case is reported once."""
    if diagnosis not in checks.failures:
        checks.fail(diagnosis)


def p2p_mistakes(calls: Recorder, name: str, ring: bool = False, returned: bool = True) -> list[str]:
    """What the recorded calls did that the lab's contract rules out, whatever the values came out
    as: each is an effect of the calls (whom they talked to, when they completed), and each is
    required by the function's docstring ("name the peer of every recv"; all_gather: "a ring: each
    rank talks to its two neighbours only", each step's send and receive posted at once and both
    waited for before the next step: plain isend/irecv or one dist.batch_isend_irecv alike); a request
    left in flight when the function returned is a result not yet there (a receive) or a buffer the
    caller may change while it is still being sent (ringside.effects names it)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    found = []
    if any(op["kind"] in ("recv", "irecv") and op["peer"] is None for op in calls.ops):
        found.append(f"{name} called recv without src: a receive from any rank takes whichever message comes "
                     f"first (at 3 or more ranks not always the one you meant), and NCCL has no such receive - "
                     f"name the sender: dist.recv(t, src=peer)")
    unwaited = unwaited_diagnosis(name, calls.ops) if returned else None
    if unwaited:
        found.append(unwaited)
    if not ring:
        return found
    sends = [op for op in calls.ops if "send" in op["kind"]]
    recvs = [op for op in calls.ops if "recv" in op["kind"]]
    if any(r["ptr"] == t["ptr"] and (r["index"] in t["pending"] or t["index"] in r["pending"])
           for r in recvs for t in sends):
        found.append(f"{name} sent a slot while a receive into it was still in flight (its values had not "
                     f"arrived yet): wait for each step's requests before the next step sends what arrived, "
                     f"and never send the slot you are receiving")
    if world_size > 2:  # either direction is a ring; at 2 ranks every peer is a neighbour
        neighbours = {(rank + 1) % world_size, (rank - 1) % world_size}
        strangers = sorted({op["peer"] for op in calls.ops if op["peer"] not in neighbours}, key=str)
        if strangers:
            found.append(f"{name} talked to rank(s) {strangers}, which are not this rank's neighbours "
                         f"{sorted(neighbours)}: in a ring each rank talks to its two neighbours only")
    return found


def drain(calls: Recorder) -> None:
    """Wait here for what the learner's function left in flight, so that the check's own messages
    that follow do not meet it (its mistake is named from the record, which this does not change)."""
    for op in calls.ops:
        if not op["completed"] and op.get("work") is not None:
            op["work"].wait()


class Stop(Exception):
    """The learner's call never finished: the group is unusable, so the check stops here."""


def peer_mistakes(calls: Recorder, name: str, root: int | None) -> list[str]:
    """Why a broadcast or gather that failed may have failed: a rank that talked to itself, or a
    message between two ranks that are not the root. (Only used once the call failed: a tree
    broadcast, where ranks pass the tensor on, is right.)"""
    if root is None:
        return []
    rank, arg = dist.get_rank(), "src" if name == "broadcast" else "dst"
    for op in calls.ops:
        peer, receives = op["peer"], "recv" in op["kind"]
        if peer == rank:
            return [f"{name} with root {root}: rank {rank} tried to {'receive from' if receives else 'send to'} "
                    f"itself - the root is `{arg}`, whichever rank the caller names (not always 0)"]
        if peer is not None and rank != root and peer != root:
            return [f"{name} with root {root}: rank {rank} {'received from' if receives else 'sent to'} rank "
                    f"{peer} - the root is `{arg}`, whichever rank the caller names (not always 0)"]
    return []


def run_watched(checks: Checks, name: str, fn, *args, ring: bool = False, root: int | None = None) -> list[str]:
    """Run one of the learner's functions with its calls recorded and fail each mistake they show
    (returned too); a call that timed out or failed in torch.distributed becomes Stop, with what the
    calls showed (gloo's own message, such as "Pair is not connected", rarely names the cause)."""
    with Recorder(refuse=COLLECTIVES, namespaces=lab_namespaces(fn)) as calls:
        try:
            fn(*args)
        except DeviceMismatch:  # on the stand-in GPU: named by check_on_gpu
            raise
        except RuntimeError as error:
            text = str(error).lower()
            found = peer_mistakes(calls, name, root) + p2p_mistakes(calls, name, ring, returned=False)
            if "timed out" in text or "closed" in text:
                raise Stop(f"{name} never finished (a send or recv timed out: likely a deadlock) - " + (
                    "; ".join(found) if found else "every send needs a matching recv on the other rank, posted "
                                                   "so that neither waits for the other first")) from None
            if not found:
                raise
            first_line = str(error).strip().splitlines()[0][:120]
            raise Stop(f"{name} failed in torch.distributed ({first_line}) - " + "; ".join(found)) from None
        try:
            drain(calls)
        except RuntimeError:
            raise Stop(f"{name} left requests in flight that never finished - "
                       + "; ".join(p2p_mistakes(calls, name, ring))) from None
    mistakes = p2p_mistakes(calls, name, ring)
    for mistake in mistakes:
        fail_once(checks, mistake)
    return mistakes


def blank_slots(like: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """One tensor per rank, every value SENTINEL: a slot nobody wrote is easy to tell."""
    return [torch.full_like(like, SENTINEL) for _ in range(world_size)]


def check_broadcast(checks: Checks, inputs: list[torch.Tensor], what: str) -> None:
    """Exact equality (a broadcast only copies bytes) with dist.broadcast, from every root."""
    rank = dist.get_rank()
    for src in range(len(inputs)):
        mine, theirs = inputs[rank].clone(), inputs[rank].clone()
        run_watched(checks, "broadcast", lab.broadcast, mine, src, root=src)
        dist.broadcast(theirs, src)
        holders = [None] * len(inputs)  # whose tensor each rank holds now: the mistake shows in all of them
        dist.all_gather_object(holders, next((r for r, x in enumerate(inputs) if torch.equal(mine, x)), None))
        if torch.equal(mine, theirs):
            checks.expect(True, "")
            continue
        held = who_holds(mine, inputs)
        checks.fail(f"broadcast from rank {src} of {what}: this rank holds {held}" + (
            "" if "rounded" in held else f", expected rank {src}'s tensor: {broadcast_hint(holders, rank, src)}"))


def broadcast_hint(holders: list[int | None], rank: int, src: int) -> str:
    """The likely mistake when rank r holds rank holders[r]'s tensor after a broadcast from `src`."""
    others = [r for r in range(len(holders)) if r not in (src, 0)]
    if src != 0 and (others or holders[src] == 0) and all(holders[r] == 0 for r in others + [src]):
        return f"the ranks got rank 0's tensor, but the root is rank {src}: send from (and receive from) `src`, not 0"
    receivers = [r for r in range(len(holders)) if r != src]
    if rank != src and all(holders[r] == r for r in receivers):
        return ("the receiving ranks still hold their own tensors: broadcast works in place - receive "
                "into `tensor` itself (assigning a new tensor to the name does not change the caller's)")
    if rank == src:
        return "the root's own tensor must not change"
    return f"receive from rank {src}, the root"


def check_gather(checks: Checks, inputs: list[torch.Tensor], what: str) -> None:
    """Exact equality with dist.gather, to every destination, in the caller's own tensors."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for dst in range(world_size):
        mine = blank_slots(inputs[rank], world_size) if rank == dst else None
        theirs = blank_slots(inputs[rank], world_size) if rank == dst else None
        slots = list(mine) if mine is not None else None  # the caller's tensors: they must be filled
        run_watched(checks, "gather", lab.gather, inputs[rank].clone(), mine, dst, root=dst)
        dist.gather(inputs[rank].clone(), theirs, dst)
        if rank != dst:
            checks.expect(True, "")
            continue
        wrong = [i for i in range(world_size) if not torch.equal(slots[i], theirs[i])]
        if not wrong:
            checks.expect(True, "")
            continue
        slot = wrong[0]
        rebound = slots[slot] is not mine[slot] and torch.equal(mine[slot], theirs[slot])
        if rebound:
            hint = (f"gather_list[{slot}] was replaced by another tensor - fill the tensors the caller gave "
                    f"you in place (gather_list[{slot}].copy_(...) or recv into it)")
        elif who_holds(slots[slot], inputs).startswith("rank "):
            other = who_holds(slots[slot], inputs).split()[1].rstrip("'s")
            hint = (f"rank {other}'s tensor landed in slot {slot} - receive rank k's tensor into gather_list[k] "
                    f"(the list is in rank order)")
        elif slot == dst:
            hint = f"the destination's own slot: copy your tensor into gather_list[{dst}]"
        else:
            hint = f"receive rank {slot}'s tensor into gather_list[{slot}] (the list is in rank order)"
        checks.fail(f"gather to rank {dst} of {what}: gather_list[{slot}] holds "
                    f"{who_holds(slots[slot], inputs)}, expected rank {slot}'s tensor: {hint}")


def holder(t: torch.Tensor, inputs: list[torch.Tensor]) -> int | None:
    """Whose input `t` is: a rank, None for the sentinel (never written), -1 for anything else."""
    found = next((r for r, x in enumerate(inputs) if torch.equal(t, x)), None)
    return found if found is not None else (None if (t == SENTINEL).all() else -1)


def ring_outcome(n: int, to, send_slot, recv_slot) -> list[list[int | None]]:
    """Whose tensor each slot of each rank holds after a ring all_gather that sends to to(r) at
    every step, sends slot send_slot(r, s) and receives into slot recv_slot(r, s)."""
    state = [[r if slot == r else None for slot in range(n)] for r in range(n)]
    for s in range(n - 1):
        arriving = {to(r): state[r][send_slot(r, s)] for r in range(n)}
        for r in range(n):
            state[r][recv_slot(r, s)] = arriving[r]
    return state


RING_MISTAKES = {  # a known mistake, its outcome on n ranks, and what to say when it matches exactly
    "other way": (lambda n: ring_outcome(n, lambda r: (r - 1) % n, lambda r, s: (r - s) % n,
                                         lambda r, s: (r - s - 1) % n),
                  "the messages go one way round the ring (to rank - 1) and the slot numbers the other way: at "
                  "each step send on the slot that arrived at the step before, and receive into the slot that "
                  "your sender is sending"),
    "own slot": (lambda n: ring_outcome(n, lambda r: (r + 1) % n, lambda r, s: r, lambda r, s: (r - s - 1) % n),
                 "this rank sent its own slot at every step: at each step send on the slot that arrived at the "
                 "step before (at step 0 your own)"),
}


def check_all_gather(checks: Checks, inputs: list[torch.Tensor], what: str) -> None:
    """Exact equality with dist.all_gather; and the ring's calls follow the contract."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine, theirs = blank_slots(inputs[rank], world_size), blank_slots(inputs[rank], world_size)
    mistakes = run_watched(checks, "all_gather", lab.all_gather, mine, inputs[rank].clone(), ring=True)
    dist.all_gather(theirs, inputs[rank].clone())
    holders = [None] * world_size  # every rank's outcome: a known mistake is named only if all match it
    dist.all_gather_object(holders, [holder(t, inputs) for t in mine])
    wrong = [i for i in range(world_size) if not torch.equal(mine[i], theirs[i])]
    if not wrong:
        checks.expect(True, "")
        return
    if mistakes:  # the values are wrong because of what was named above
        return
    slot = wrong[0]
    known = [why for outcome, why in RING_MISTAKES.values() if outcome(world_size) == holders]
    if known:
        hint = known[0]
    elif all((t == SENTINEL).all() for t in mine):  # nothing real ever entered the ring
        hint = (f"every slot is empty: fill your own slot first (copy your tensor into "
                f"tensor_list[{rank}]), then the ring passes it on")
    elif wrong == [rank]:
        hint = f"your own slot: copy your tensor into tensor_list[{rank}] first"
    else:
        hint = ("off by one? at each step a rank sends on the slot it received at the step before, and "
                "what it receives belongs in the slot its sender sent")
    checks.fail(f"all_gather of {what}: tensor_list[{slot}] holds "
                f"{who_holds(mine[slot], inputs)}, expected rank {slot}'s tensor: {hint}")


def main(me: Rank, checks: Checks) -> None:
    world_size = dist.get_world_size()
    if world_size == 1:
        print0("note: on 1 rank no message is sent, so only the copy of a rank's own tensor is checked, not the "
               "sends and receives: run on 2 or more ranks (3 or more for the ring's neighbours)")
    case = 0
    for shape in SHAPES:
        for dtype in DTYPES:
            inputs = [rank_tensor(r, shape, dtype, case, me.device) for r in range(world_size)]
            what = f"a {tuple(shape)} {str(dtype).replace('torch.', '')} tensor"
            try:
                check_broadcast(checks, inputs, what)
                check_gather(checks, inputs, what)
                check_all_gather(checks, inputs, what)
            except Stop as stop:
                checks.fail(str(stop))
                return
            case += 1
            # the first case that fails on any rank tells enough: every rank stops together
            failed = torch.tensor([len(checks.failures)], device=me.device)
            dist.all_reduce(failed)
            if failed.item():
                return
    print0(f"compared broadcast, gather and all_gather with torch.distributed's own: "
           f"{len(SHAPES)} shapes x {len(DTYPES)} dtypes, every root, {ranks_count(world_size)}")
    if passed_on_every_rank(checks):
        check_on_gpu(checks)


def check_on_gpu(checks: Checks) -> None:
    """broadcast, gather and all_gather once more as `make lab` runs them on a GPU machine, on one case:
    the tensors on this rank's stand-in GPU, NCCL's rules for what send and recv accept
    (ringside.effects.rank_gpu). A buffer made on the CPU is named where it is made."""
    world_size = dist.get_world_size()
    with rank_gpu(lab.broadcast, lab.gather, lab.all_gather) as (gpu, _):
        inputs = [rank_tensor(r, SHAPES[0], DTYPES[0], 0, gpu.device) for r in range(world_size)]
        what = f"a {tuple(SHAPES[0])} {str(DTYPES[0]).replace('torch.', '')} tensor on this rank's GPU"
        for name, check in (("broadcast", check_broadcast), ("gather", check_gather), ("all_gather", check_all_gather)):
            try:
                _, problem = device_problem(name, check, checks, inputs, what)
            except Stop as stop:
                checks.fail(str(stop))
                return
            if not checks.expect(problem is None, problem or ""):
                return


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    # A short timeout: a send/recv that no rank matches fails in 10 s as a likely deadlock.
    run_lab(main, title="Lab 03 (collectives)", timeout=timedelta(seconds=10))
