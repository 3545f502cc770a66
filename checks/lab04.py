"""The check of lab 04 (ring_allreduce): it runs the code of labs/04_ring_allreduce.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

from datetime import timedelta
from itertools import product
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import DryRun, Recorder, lab_namespaces
from ringside.compare import equal_on_all_ranks, max_diff
from ringside.data import regression
from ringside.effects import device_diagnosis, device_problem, misplaced_result, passed_on_every_rank, rank_gpu
from ringside.lab import explain, ranks_count
from ringside.standin import DeviceMismatch, origin

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The check ------------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)


def chunking_problem(numel: int, world_size: int, device: torch.device) -> str | None:
    """What is wrong with ring_chunks on `numel` elements for `world_size` chunks (None if nothing)."""
    flat = torch.arange(numel, dtype=torch.float32, device=device)
    base, extra = divmod(numel, world_size)
    want = [base + (1 if i < extra else 0) for i in range(world_size)]
    try:
        chunks = list(lab.ring_chunks(flat, world_size))
    except NotImplementedError:
        raise
    except Exception as error:  # the learner's mistake becomes a diagnosis, not a crash of the check
        return f"ring_chunks on {numel} elements for {ranks_count(world_size)} raised {type(error).__name__}: {error}"
    sizes = [c.numel() for c in chunks]
    where = f"ring_chunks on {numel} elements for {ranks_count(world_size)} gave sizes {sizes}"
    if len(chunks) != world_size:
        return (f"{where}: {len(chunks)} chunks, not {world_size} - every rank needs a chunk even when they do not "
                f"divide evenly (flat.chunk(n) may return fewer than n; slice by sizes, or use tensor_split)")
    if sizes != want:
        return f"{where}, expected {want}: the first numel % world_size chunks get one extra element"
    if not torch.equal(torch.cat(chunks), flat):
        return f"{where}: together they are not `flat` in order"
    if not all(c.numel() == 0 or c.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for c in chunks):
        return (f"{where}: the chunks are copies, not views of `flat` - the ring writes into the chunks, and "
                f"`tensor` must see it (slice; no .clone() or torch.cat)")
    return None


def check_chunks(checks: Checks, device: torch.device) -> bool:
    """ring_chunks on its own, a pure function: exactly N views, in order, sized base or base + 1,
    first ones larger, on every size of 0 to 64 elements for every N of 1 to 9 (and the job's own),
    smallest first (585 cases, about 30 ms): the first failure is the smallest failing input."""
    most = max(9, dist.get_world_size())
    cases = sorted(product(range(max(65, 6 * most)), range(1, most + 1)), key=lambda case: (sum(case), case[0]))
    problem = next(filter(None, (chunking_problem(numel, world_size, device) for numel, world_size in cases)), None)
    return checks.expect(problem is None, problem or "")


VIRTUAL = 3  # the dry run plays a 3-rank ring: at 2 ranks left and right are the same rank
ARRIVES = 7.0  # what the dry run's receives deliver
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
               "all_gather_into_tensor", "broadcast", "barrier")


def exchange_mistakes(device: torch.device) -> str:
    """send_right_receive_left played as each rank of a 3-rank ring, with nothing sent (so that a
    mistake cannot hang): whom it talks to, with which buffers, and whether it waits. "" if fine."""
    for rank in range(VIRTUAL):
        right, left = (rank + 1) % VIRTUAL, (rank - 1) % VIRTUAL
        outgoing, incoming = torch.full((4,), 5.0, device=device), torch.zeros(4, device=device)
        who = (f"send_right_receive_left, played as rank {rank} of {VIRTUAL} (a dry run: its calls noted, "
               f"nothing sent),")
        with DryRun(refuse=COLLECTIVES, arrives=ARRIVES, plays=(rank, VIRTUAL)) as calls:
            try:
                lab.send_right_receive_left(outgoing, incoming)
            except NotImplementedError:
                raise
            except Exception as error:  # shown by the real exchange that follows, where it is no dry run
                return f"{who} failed: {error}" if "was called: this lab builds" in str(error) else ""
        sends = [op for op in calls.ops if "send" in op["kind"]]
        recvs = [op for op in calls.ops if "recv" in op["kind"]]
        blocking = [op["kind"] for op in calls.ops[:1] if op["kind"] in ("send", "recv")]
        if blocking:  # a blocking call after an isend/irecv is no deadlock; `loose` below names it
            return (f"{who} called the blocking dist.{blocking[0]} first: every rank calls it at the same moment, "
                    f"so each waits there for a neighbour that is itself waiting - likely a deadlock"
                    + (" (gloo lets a small send through, NCCL and large messages do not)"
                       if blocking[0] == "send" else "")
                    + ". Both messages must be under way at once: post the send and the receive together "
                      "(isend and irecv), then wait on both")
        if len(sends) != 1 or len(recvs) != 1:
            return (f"{who} posted {len(sends)} send(s) and {len(recvs)} receive(s): it needs exactly one of "
                    f"each - `outgoing` to rank + 1, `incoming` from rank - 1")
        to, source = sends[0]["peer"], recvs[0]["peer"]
        if (to, source) == (left, right):
            return (f"{who} sent to rank {to} and received from rank {source}: it sends to the left and "
                    f"receives from the right - the ring goes the other way (at 2 ranks left and right are "
                    f"the same rank, so only 3 or more ranks show it)")
        if (to, source) != (right, left):
            return (f"{who} sent to rank {to} and received from rank {source}: it must send to rank + 1 = "
                    f"{right} and receive from rank - 1 = {left}, wrapping around (% world_size)")
        unwaited = [op["kind"] for op in calls.ops if not op["waited"]]
        if unwaited:
            return (f"{who} returned without waiting on its {' and '.join(unwaited)}: "
                    + ("`incoming` may not hold the neighbour's values yet when the ring reads it (and a "
                       "request left in flight can stall the next call) - " if "irecv" in unwaited else
                       "`outgoing` may still be in flight when the ring changes it - ")
                    + "wait on every request (the irecv too) before using the buffers")
        if not torch.equal(sends[0]["sent"], outgoing) or sends[0]["ptr"] == incoming.data_ptr():
            return (f"{who} sent something other than `outgoing` - are `outgoing` and `incoming` swapped? "
                    f"Send `outgoing`, receive into `incoming`")
        if not torch.all(incoming == ARRIVES):
            return (f"{who} returned with `incoming` not holding what arrived: receive into `incoming` itself "
                    f"(or copy the arrival into it, in place)")
        if not torch.all(outgoing == 5.0):
            return f"{who} changed `outgoing`: it must only be sent"
        loose = [op["kind"] for op in calls.ops if not op["batch"]]
        if loose:
            return (f"{who} posted its {' and '.join(loose)} one by one: NCCL wants a send and a receive that "
                    f"run at the same time posted together as one group - pass both as dist.P2POp to "
                    f"dist.batch_isend_irecv")
    return ""


def check_exchange(checks: Checks, device: torch.device) -> bool:
    """send_right_receive_left on its own: first a dry run as a 3-rank ring (peers, buffers, waits,
    whatever the real world size), then for real: rank r must receive its left neighbour's values."""
    mistake = exchange_mistakes(device)  # the same on every rank: all stop here together
    if mistake:
        return checks.expect(False, mistake)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:  # no neighbour: the ring makes no exchange (gloo and NCCL refuse a message to oneself)
        return checks.expect(True, "")
    left = (rank - 1) % world_size
    outgoing = torch.arange(4, dtype=torch.float32, device=device) + 100 * rank
    incoming = torch.full((4,), -1.0, device=device)
    lab.send_right_receive_left(outgoing, incoming)
    got = incoming.cpu()
    if torch.equal(got, torch.arange(4.0) + 100 * left):
        return checks.expect(True, "")
    if torch.equal(got, torch.full((4,), -1.0)):
        return checks.expect(False, f"send_right_receive_left returned, but nothing arrived in `incoming` "
                                    f"(expected rank {left}'s values) - did you wait on the receive?")
    return checks.expect(False, f"send_right_receive_left: `incoming` holds {got.tolist()}, not rank {left}'s "
                                f"values {(torch.arange(4.0) + 100 * left).tolist()}")


def ring_cases(world_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every dtype on a size divisible by world_size first (so a chunk-index mistake is seen
    before a size one), then sizes that are not: a remainder, fewer elements than ranks, 2-D."""
    f16, bf16, f32, f64, i32, i64 = DTYPES
    even = [((world_size * 5,), dtype) for dtype in DTYPES] + [((world_size * 64, 3), f32)]
    odd = [((world_size * 5 + 1,), f32), ((world_size * 5 + 1,), i64), ((world_size * 5 + 1,), f16),
           ((world_size * 64 + world_size - 1,), f64), ((1,), f32), ((7, 13), bf16), ((7, 13), i32)]
    return even + odd


def example(shape: tuple[int, ...], dtype: torch.dtype, rank: int, device: torch.device) -> torch.Tensor:
    """Different values on every rank. Floats are random normals; the 16-bit floats and the
    integers get small integers, whose sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    if dtype in (torch.float32, torch.float64):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return torch.randint(-8, 9, shape, generator=g).to(dtype).to(device)


def tolerance(dtype: torch.dtype, inputs_abs_sum: torch.Tensor, world_size: int) -> torch.Tensor:
    """Per element. The ring and gloo add the same N numbers in different orders; each order is
    within (N-1)*eps*sum|x| of the exact sum, so the two are within twice that. Exact sums
    (integers, and the small integers we give the 16-bit floats) must be equal."""
    if dtype.is_floating_point and dtype in (torch.float32, torch.float64):
        return 2 * (world_size - 1) * torch.finfo(dtype).eps * inputs_abs_sum
    return torch.zeros_like(inputs_abs_sum)


class UsedCollective(RuntimeError):
    pass


def forbid_collectives():
    """While the ring runs, the collectives that would do the job for it raise UsedCollective."""
    names = COLLECTIVES
    saved = {name: getattr(dist, name) for name in names}

    def refuse(name):
        def call(*args, **kwargs):
            raise UsedCollective(f"ring_all_reduce called dist.{name} - build it from isend/irecv only")
        return call

    for name in names:
        setattr(dist, name, refuse(name))
    return lambda: [setattr(dist, name, fn) for name, fn in saved.items()]


class BadBuffer(RuntimeError):
    pass


class LeftBehind(RuntimeError):
    pass


EXCHANGING, DONE = 1, 0  # the first number of every row the check's group carries during a ring


def rows_of_all(group: dist.ProcessGroup, row: list[int]) -> list[list[int]]:
    """Every rank's row of four numbers, in rank order (c10d's all_gather: dist's is refused in the ring)."""
    from torch.distributed import distributed_c10d as c10d
    every = [torch.zeros(4, dtype=torch.int64) for _ in range(dist.get_world_size())]
    c10d.all_gather(every, torch.tensor(row), group=group)
    return [t.tolist() for t in every]


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the two views overlap in memory (two chunks of one tensor do not)?"""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_end, b_end = a.data_ptr() + a.numel() * a.element_size(), b.data_ptr() + b.numel() * b.element_size()
    return a.data_ptr() < b_end and b.data_ptr() < a_end


def watched_exchange(group: dist.ProcessGroup):
    """send_right_receive_left as the ring calls it, after the ranks compare notes on the check's
    group (all together, so that all stop at the same call): has a rank left the ring already, and
    has each rank's `incoming` room for exactly what its left neighbour sends? Any would
    otherwise crash one rank and leave the others waiting for it."""
    learners, calls = lab.send_right_receive_left, [0]

    def exchange(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
        world_size = dist.get_world_size()
        kind = 0 if (incoming.dtype, incoming.device) == (outgoing.dtype, outgoing.device) else (
            1 if incoming.dtype != outgoing.dtype else 2)
        if kind == 0 and shares_memory(outgoing, incoming):
            kind = 3  # what arrives would overwrite what is being sent: the result depends on timing
        rows = rows_of_all(group, [EXCHANGING, outgoing.numel(), incoming.numel(), kind])
        gone = [r for r, row in enumerate(rows) if row[0] == DONE]
        if gone:
            raise LeftBehind(f"the ring stopped waiting for rank {gone[0]}, whose ring_all_reduce stopped first "
                             f"(see its line)" if rows[gone[0]][1] else
                             f"rank {gone[0]} had finished its ring while this rank still exchanged - do all "
                             f"ranks run the same number of steps (N-1 per phase)?")
        calls[0] += 1
        phase, step = ("scatter-reduce", calls[0] - 1) if calls[0] < world_size else ("all-gather", calls[0] - world_size)
        for r in range(world_size):
            if rows[r][3] == 3:
                raise BadBuffer(f"at step {step} of the {phase}, rank {r} received into the very chunk it was "
                                f"sending: is there an off-by-one chunk index in the {phase}? (at each step a "
                                f"rank sends one chunk and receives another)")
            if rows[r][3]:
                what = "dtype" if rows[r][3] == 1 else "device"
                made = origin(incoming) if kind == rows[r][3] else None  # where this rank made its own
                raise BadBuffer(f"at step {step} of the {phase}, rank {r} received into a buffer of another {what} "
                                f"than the chunk it sent" + (f" (made by {made})" if made else "") + ": the receive "
                                f"buffer must have the tensor's dtype and device (torch.empty_like, not torch.empty)")
            sent, room = rows[(r - 1) % world_size][1], rows[r][2]
            if sent != room:
                raise BadBuffer(f"at step {step} of the {phase}, rank {r} received into a buffer of {room} "
                                f"elements while rank {(r - 1) % world_size} sent {sent}: chunks differ in size "
                                f"when the length does not divide by world_size - receive into a buffer of the "
                                f"incoming chunk's size")
        learners(outgoing, incoming)

    exchange.count = lambda: calls[0]  # exchanges made so far, for run_ring
    return exchange


def run_ring(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[int, str | None, list[int]]:
    """Call the learner's ring on every rank; return how it ended here - 0 (finished), 1 (waited
    for another rank in vain) or 2 (stopped by itself) - with a diagnosis, and every rank's code.
    Returns on all ranks together, even when one rank's ring crashed half-way."""
    restore, learners = forbid_collectives(), lab.send_right_receive_left
    exchange = watched_exchange(group)
    namespace = lab.ring_all_reduce.__globals__  # the lab's own globals, where its ring finds the exchange
    namespace["send_right_receive_left"] = exchange
    code, why = 0, None
    try:
        lab.ring_all_reduce(tensor)
        world_size, made = dist.get_world_size(), exchange.count()
        if made > 2 * (world_size - 1):  # the sum may still be right: a wasted step is seen only here
            code, why = 2, (f"ring_all_reduce made {made} exchanges on {ranks_count(world_size)}, where the ring needs "
                            f"N - 1 = {world_size - 1} per phase, {2 * (world_size - 1)} in all: each extra step "
                            f"sends another chunk (each rank sends {made}/{world_size} of the tensor instead of "
                            f"2(N-1)/N) - run each phase for exactly N - 1 steps")
    except (UsedCollective, BadBuffer) as error:
        code, why = 2, str(error)
    except DeviceMismatch as error:  # on the stand-in GPU: a tensor where a GPU run would not have it
        code, why = 2, device_diagnosis("ring_all_reduce", error)
    except LeftBehind as error:
        code, why = 1, str(error)
    except NotImplementedError:
        raise
    except Exception as error:  # a crash on one rank must not leave the others waiting for ever
        text = str(error).lower()
        if "timed out" in text or "closed" in text or "reset by peer" in text:
            code, why = 1, ("the ring stopped: a send or recv timed out - likely a deadlock. If every rank first "
                            "waits in a blocking recv (or send), no rank ever gets to its send: post isend and "
                            "irecv together, then wait on both")
        else:
            code, why = 2, f"ring_all_reduce raised {explain(error)}"
    finally:
        namespace["send_right_receive_left"] = learners
        restore()
    # Say DONE until every rank says it: a rank still inside its ring sees DONE in exchange() and leaves.
    while True:
        rows = rows_of_all(group, [DONE, code, 0, 0])
        if all(row[0] == DONE for row in rows):
            codes = [row[1] for row in rows]
            break
    crashed = [r for r, c in enumerate(codes) if c == 2]
    if code == 1 and crashed:  # this rank only waited for a rank whose ring stopped by itself
        why = f"the ring stopped waiting for rank {crashed[0]}, whose ring_all_reduce stopped first (see its line)"
    return code, why, codes


BASE = 100  # probe digits: rank r gives BASE**r; float64 holds BASE**7 exactly, so up to 7 ranks


def contributions(world_size: int, device: torch.device, group: dist.ProcessGroup) -> list[list[int]] | None:
    """Run the learner's ring once more on a probe: rank r gives BASE**r everywhere, so each digit
    (base BASE) of the result counts how often one rank's values got into it (a right sum is 1 each).
    Returns, per chunk, the count of every rank; None where the result is no such number."""
    if world_size > 7:
        return None
    # equal chunks: a wrong chunk index then mixes up values without a size mismatch
    probe = torch.full((world_size * 3,), float(BASE ** dist.get_rank()), dtype=torch.float64, device=device)
    if any(run_ring(probe, group)[2]):
        return None
    counts = []
    for chunk in probe.cpu().tensor_split(world_size):
        value = chunk[0].item()
        if not torch.all(chunk == value) or value < 0 or value != int(value) or value >= BASE ** world_size:
            return None
        counts.append([int(value) // BASE ** r % BASE for r in range(world_size)])
    return counts


def simulate(world_size: int, mistake: str) -> list[list[list[int]]]:
    """The probe's counts on every rank for a ring with one known mistake (or none)."""
    n = world_size
    state = [[[1 if k == r else 0 for k in range(n)] for c in range(n)] for r in range(n)]

    def step(send_of, receive_of, combine):
        sent = [list(state[r][send_of(r)]) for r in range(n)]
        for r in range(n):
            arrived, c = sent[(r - 1) % n], receive_of(r)
            state[r][c] = combine(state[r][c], arrived)

    add = lambda mine, arrived: [a + b for a, b in zip(mine, arrived)]  # noqa: E731
    double = lambda mine, arrived: [2 * b for b in arrived]  # noqa: E731
    replace = lambda mine, arrived: list(arrived)  # noqa: E731
    for s in range(n - 1):
        receive = (lambda r: (r - s + 1) % n) if mistake == "scatter index" else (lambda r: (r - s - 1) % n)
        step(lambda r: (r - s) % n, receive, double if mistake == "receive into chunk" else add)
    if mistake != "no all-gather":
        for s in range(n - 1):
            send = (lambda r: (r - s) % n) if mistake == "gather index" else (lambda r: (r + 1 - s) % n)
            step(send, lambda r: (r - s) % n, add if mistake == "gather adds" else replace)
    return state


MISTAKES = {
    "receive into chunk": "did you receive into the chunk itself and then add? The arrival overwrote this "
                          "rank's own values: receive into `landing`, then add it to the chunk",
    "gather adds": "does the all-gather phase add what arrives? It must replace the chunk, not add to it",
    "scatter index": "an off-by-one chunk index in the scatter-reduce? At each step a rank sends on the chunk "
                     "it received (and added to) at the step before",
    "gather index": "an off-by-one chunk index in the all-gather? At each step a rank sends on the chunk it "
                    "received at the step before, starting with the one it reduced",
    "no all-gather": "is the all-gather phase missing?",
}


def diagnose_counts(counts: list[list[int]] | None, world_size: int) -> str:
    """Which known mistake makes the probe come out as it did on this rank ("" if none fits)."""
    if counts is None:
        return ""
    rank = dist.get_rank()
    for mistake, diagnosis in MISTAKES.items():
        if simulate(world_size, mistake)[rank] == counts and simulate(world_size, "")[rank] != counts:
            return f"the probe (rank r adds {BASE}**r) matches that mistake exactly: {diagnosis}"
    return ""


def diagnose_ring(result: torch.Tensor, expected: torch.Tensor, mine: torch.Tensor, tol: torch.Tensor,
                  world_size: int, probe: str) -> str:
    """What is wrong with `result`, and the likely mistake."""
    rank, numel = dist.get_rank(), result.numel()
    wrong = ((result.double() - expected.double()).abs() > tol).view(-1).cpu()
    where = (f"{tuple(result.shape)} {str(result.dtype).replace('torch.', '')}: "
             f"{int(wrong.sum())} of {numel} elements differ from dist.all_reduce")
    if result.isnan().any() and not mine.isnan().any():
        return f"{where}, and some are NaN - was a buffer read before anything arrived in it (torch.empty)?"
    if torch.equal(result, mine) and world_size > 1:
        return f"{where} - the tensor is unchanged: write the sums into `tensor` itself (in place)"
    if (result.double() * world_size - expected.double()).abs().max() <= tol.max() * world_size + 1e-6:
        return f"{where}: they are 1/{world_size} of the sum - ring_all_reduce sums; averaging is the caller's job"
    if probe:  # the probe matched one known mistake exactly
        return f"{where} - {probe}"
    covered = world_size * (numel // world_size)
    if numel % world_size and not wrong[:covered].any():
        return (f"{where}, all in the last {numel % world_size} - the remainder chunk dropped? With numel "
                f"% world_size != 0, the first numel % world_size chunks need one extra element")
    bounds = [c.numel() for c in torch.arange(numel).tensor_split(world_size)]
    good = [not w.any() for w in wrong.split(bounds)]
    if good.count(True) == 1 and good.index(True) == (rank + 1) % world_size:
        return (f"{where}: only chunk {(rank + 1) % world_size}, the one this rank reduced, is right - "
                f"is the all-gather phase missing? Or does it rebind chunks[i] = ... where it must write "
                f"into the chunk (receive into it, or chunks[i].copy_(...))?")
    if good.count(True) == 1 and good.index(True) == rank:
        return (f"{where}: only chunk {rank}, the one this rank's all-gather received first, is right - did "
                f"the scatter-reduce rebind chunks[i] = chunks[i] + arrived? That makes a new tensor, no "
                f"longer a view of `tensor`, so the sums never reach it: add in place (chunks[i] += arrived)")
    right = ", ".join(str(c) for c, ok in enumerate(good) if ok) or "none"
    return (f"{where} (chunks right: {right}) - an off-by-one chunk index? In each phase a rank sends on the "
            f"chunk it received at the step before")


def check_ring(checks: Checks, device: torch.device, cases: list | None = None) -> bool:
    """The ring against dist.all_reduce on the same inputs (`cases`, all of ring_cases by default);
    stops at the first failure."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The check's own messages go on a group of their own, CPU and gloo whatever the backend, with
    # a long timeout: a rank whose ring crashed waits there while the others' recvs time out (10 s).
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    for shape, dtype in cases or ring_cases(world_size):
        mine = example(shape, dtype, rank, device)
        expected = mine.clone()
        dist.all_reduce(expected)
        abs_sum = mine.double().abs()
        dist.all_reduce(abs_sum)
        result = mine.clone()
        stopped, why, codes = run_ring(result, group)
        if stopped:
            return checks.expect(False, f"{shape} {str(dtype).replace('torch.', '')}: {why}")
        if any(codes):
            checks.expect(True, "")  # this rank's ring finished; another's did not (its line says why)
            return False
        ok = result.dtype == dtype and result.shape == mine.shape and bool(
            ((result.double() - expected.double()).abs() <= tolerance(dtype, abs_sum, world_size)).all())
        # Every rank must learn whether any rank's values are wrong: then all run the probe together.
        if any(row[1] for row in rows_of_all(group, [DONE, int(not ok), 0, 0])):
            tol = tolerance(dtype, abs_sum, world_size)
            probe = diagnose_counts(contributions(world_size, device, group), world_size)
            checks.expect(ok, "" if ok else diagnose_ring(result, expected, mine, tol, world_size, probe))
            return False
        checks.expect(True, "")
    return True


def check_one_ring_per_step(checks: Checks, recorded: Recorder, device: torch.device) -> bool:
    """average_gradients' contract: "one ring_all_reduce on one flat buffer of all gradients". Measured
    as an effect: the messages sent per training step, against what your own ring sends to sum one
    buffer that holds every gradient (the same count whatever its size). Blind at 1 rank: no messages."""
    world_size = dist.get_world_size()
    if world_size == 1:
        return checks.expect(True, "")
    sent = sum(1 for op in recorded.ops if "send" in op["kind"]) / lab.STEPS
    model = lab.make_model()
    flat = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad), device=device)
    with Recorder() as one:
        lab.ring_all_reduce(flat)
    per_ring = sum(1 for op in one.ops if "send" in op["kind"])
    if per_ring and sent > per_ring:
        return checks.expect(False, f"average_gradients sent {sent:g} messages per step on this rank, where one "
                                    f"ring_all_reduce of one flat buffer holding every gradient sends {per_ring}: "
                                    f"{sent / per_ring:g} rings per step - the contract asks for one ring on one "
                                    f"flat buffer of all gradients (fewer, larger messages: each message pays the "
                                    f"latency α once)")
    return checks.expect(True, "")


def check_training(checks: Checks, device: torch.device) -> bool:
    """The home-made DDP against DDP, step by step: same gradients, same weights."""
    world_size = dist.get_world_size()
    data = regression(n=lab.STEPS * world_size * lab.BATCH_PER_RANK)
    with Recorder(namespaces=lab_namespaces(lab.train)) as recorded:
        ours = lab.train(lab.make_model().to(device), data, device, by_hand=True)
    if not check_one_ring_per_step(checks, recorded, device):
        return False
    device_ids = [device.index] if device.type == "cuda" else None
    theirs = lab.train(DDP(lab.make_model().to(device), device_ids=device_ids), data, device, by_hand=False)
    for step, ((local, my_grads, my_weights), (_, ddp_grads, ddp_weights)) in enumerate(zip(ours, theirs)):
        if not torch.isfinite(my_grads).all():
            return checks.expect(False, f"step {step}: the averaged gradients hold NaN or inf")
        # Tolerance: DDP sums the gradients in gloo's order, we in the ring's; float32 rounding
        # differs by about 1e-7 per step, and STEPS steps stay far below 1e-5. Mistakes are > 1e-3.
        gap = max_diff(my_grads, ddp_grads)
        if gap > 1e-5:
            ratio = (my_grads.norm() / ddp_grads.norm()).item()
            if world_size > 1 and torch.equal(my_grads, local):
                hint = ("the gradients are unchanged by average_gradients: the averages never reached p.grad - "
                        "torch.cat makes a copy, so copy each slice back into its grad in place (g.copy_(...); "
                        "rebinding a name changes nothing)")
            # a ratio names a cause only where every element is off by that same factor
            elif torch.allclose(my_grads, ddp_grads * world_size, rtol=1e-4, atol=1e-6):
                hint = (f"they are {ratio:.2f}x DDP's - did you divide by world_size? DDP averages, "
                        f"ring_all_reduce only sums")
            elif world_size > 1 and torch.allclose(my_grads * world_size, ddp_grads, rtol=1e-4, atol=1e-6):
                hint = f"they are {ratio:.2f}x DDP's - did you divide by world_size twice?"
            else:
                hint = ("check how the flat buffer is copied back into each parameter's grad: does the offset "
                        "advance by each grad's numel()?")
            return checks.expect(False, f"step {step}: the averaged gradients differ from DDP's by {gap:.2e} "
                                        f"(tolerance 1e-5): {hint}")
        if not equal_on_all_ranks(my_weights):
            return checks.expect(False, f"step {step}: the weights differ between ranks although the gradients match "
                                        f"DDP's")
        gap = max_diff(my_weights, ddp_weights)
        if not checks.expect(gap <= 1e-5, f"step {step}: the weights differ from DDP's by {gap:.2e} "
                                          f"(tolerance 1e-5) although the gradients agree"):
            return False
    print0(f"home-made DDP matches DDP for {lab.STEPS} steps (max weight gap {gap:.1e})")
    return True


def check_on_gpu(checks: Checks) -> None:
    """The ring and the home-made DDP once more as `make lab` runs them on a GPU machine: the tensors
    on this rank's stand-in GPU, NCCL's rules for what send and recv accept (ringside.effects.rank_gpu).
    A buffer made on the CPU (a landing buffer, the flat gradients) is named where it is made."""
    with rank_gpu(lab.ring_all_reduce, lab.send_right_receive_left, lab.train) as (gpu, _):
        world_size = dist.get_world_size()
        # one case that divides and one that does not: the landing buffer, the chunks, the remainder
        cases = [((world_size * 5,), torch.float32), ((world_size * 5 + 1,), torch.int64)]
        if not check_ring(checks, gpu.device, cases):
            return
        data = regression(n=lab.STEPS * world_size * lab.BATCH_PER_RANK)
        model = lab.make_model().to(gpu.device)
        _, problem = device_problem("average_gradients (in train)", lab.train, model, data, gpu.device, by_hand=True)
        problem = problem or misplaced_result("average_gradients", [p.grad for p in model.parameters()], gpu.device,
                                              "a gradient it left in p.grad")
        checks.expect(problem is None, problem or "")


def main(me: Rank, checks: Checks) -> None:
    if me.world_size == 1:
        print0("note: on 1 rank the ring sends no message, so whether average_gradients uses one ring per step "
               "is not measured: run on 2 or more ranks too")
    if me.world_size == 2:
        print0("note: on 2 ranks some ring mistakes (a chunk index off by one) still give the right sum: "
               "run on 3 or 4 ranks too")
    if check_chunks(checks, me.device) and check_exchange(checks, me.device) and check_ring(checks, me.device):
        print0(f"ring_all_reduce equals dist.all_reduce on {len(ring_cases(me.world_size))} "
               f"shape/dtype cases")
        check_training(checks, me.device)
    if passed_on_every_rank(checks):
        check_on_gpu(checks)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    # A short timeout (the default is 30 s): a deadlocked ring fails after 10 s instead of hanging.
    run_lab(main, title="Lab 04 (ring_allreduce)", timeout=timedelta(seconds=10))
