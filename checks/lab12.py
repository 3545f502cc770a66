"""The check of lab 12 (ddp_internals): it runs the code of labs/12_ddp_internals.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder, lab_namespaces
from ringside.compare import all_gather_tensor, flat_params, max_diff
from ringside.effects import changed_in_flight, on_rank_gpu

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The check ------------------------------------------------------------------------------------


# Completions that block the calling thread (a wait inside a hook stalls backward); the others
# (a .then callback, is_completed() or done() found True) note a finished all-reduce without waiting.
BLOCKING = ("wait", "synchronize", "future.wait", "future.value", "wait_all")


@contextmanager
def recording_all_reduce(events: list, buffers: list | None = None, raced: list | None = None) -> Iterator[None]:
    """For the block, every all-reduce (ringside.calls.Recorder) notes ("launch", elements, async?, a copy of
    the buffer at launch) in `events`, and ("wait", how) once the lab's code has seen it finish, however it
    waited. `raced` gets the elements of each all-reduce whose buffer it changed while in flight."""
    def launched(call):
        if call.family == "all_reduce":
            events.append(("launch", call.numel, call.async_op, call.snapshot[0]))
            if buffers is not None:
                buffers.append(weakref.ref(call.tensors[0]))

    def completed(call):
        if call.family == "all_reduce" and call.completed_by != "blocking":
            events.append(("wait", call.completed_by))
            if raced is not None and changed_in_flight([call]):
                raced.append(call.numel)

    with Recorder(namespaces=lab_namespaces(lab), on_call=launched, on_complete=completed, snapshot=True):
        yield


def record_gradient_ready(model: nn.Module, events: list) -> None:
    """Note ("ready", index) when each parameter's gradient is ready (registered before HandDDP's
    own hooks, so it fires first)."""
    for index, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, index=index: events.append(("ready", index)))


def check_buckets(checks: Checks, params: list, buckets) -> bool:
    """The rules of make_buckets, checked one by one. Returns False when training cannot run."""
    exact = lab.make_buckets([torch.empty(20), torch.empty(30), torch.empty(70)], 100)
    over = lab.make_buckets([torch.empty(150), torch.empty(150)], 100)  # over the cap: closed either way
    if exact == [[2, 1, 0]] and over == [[1], [0]]:  # 70 + 30 lands exactly on the cap (the lab's model never does)
        return checks.expect(False, "make_buckets([20, 30, 70 elements], cap 100) gave [[2, 1, 0]], expected [[2, 1], "
                                    "[0]]: a bucket that holds exactly cap elements is full - close it at size >= cap, "
                                    "not > cap")
    if exact == [[2, 1]] and over == [[1], [0]]:  # the lab's model fills its last bucket; most models do not
        return checks.expect(False, "make_buckets([20, 30, 70 elements], cap 100) gave [[2, 1]], expected [[2, 1], "
                                    "[0]]: parameter 0 is in no bucket - the last bucket is rarely full: after the "
                                    "loop, keep the one still being filled")
    n = len(params)
    try:
        flat = [int(i) for bucket in buckets for i in bucket]
    except TypeError:
        return checks.expect(False, f"make_buckets returned {type(buckets).__name__}, not a list of lists of indices")
    missing = sorted(set(range(n)) - set(flat))
    strange = sorted(set(flat) - set(range(n)))
    repeated = sorted({i for i in flat if flat.count(i) > 1})
    if missing or strange or repeated:
        found = (f"parameter(s) {missing} are in no bucket, so their gradients are never averaged (an off-by-one "
                 f"in the reversed range?)" if missing else
                 f"index(es) {strange} are not parameter indices (0 to {n - 1})" if strange else
                 f"parameter(s) {repeated} are in more than one bucket")
        return checks.expect(False, f"the buckets hold indices {flat} for {n} parameters: {found} - every index "
                                    "must be in exactly one bucket")
    if flat != list(reversed(range(n))):
        if flat == list(range(n)):
            checks.fail("buckets in forward order: parameter 0 (the first layer) comes first, but backward produces "
                        "the last layer's gradients first - fill buckets in reverse registration order, or the "
                        "first bucket is only complete when backward ends and nothing overlaps")
        else:
            checks.fail(f"the buckets hold the parameters in the order {flat}, expected reverse registration order "
                        f"{list(reversed(range(n)))}: backward produces the last layer's gradients first")
        return True
    sizes = [sum(params[i].numel() for i in bucket) for bucket in buckets]
    for b, bucket in enumerate(buckets):
        full_before_last = sizes[b] - params[bucket[-1]].numel() >= lab.BUCKET_CAP
        too_small = sizes[b] < lab.BUCKET_CAP and b < len(buckets) - 1
        if full_before_last or too_small:
            checks.fail(f"bucket {b} holds {sizes[b]} elements (cap {lab.BUCKET_CAP}): bucket sizes {sizes} do not "
                        f"follow the rule - close a bucket as soon as it holds >= cap elements"
                        + (" (one bucket for everything means one all-reduce at the very end: no overlap)"
                           if len(buckets) == 1 else ""))
            return True
    checks.expect(True, "")
    return True


def check_async(checks: Checks, events: list, rank: int) -> None:
    if any(e[0] == "launch" and not e[2] for e in events):
        checks.fail(f"rank {rank}: an all-reduce had already finished when the call that launched it returned "
                    f"(called without async_op=True): it blocks inside the hook, so backward waits for the "
                    f"network - launch it asynchronously and wait later")


def events_problem(events: list, buckets: list, sizes: list[int], sync_at_forward: list) -> str | None:
    """The recorded order of events, window by window: `buckets` are the lab's buckets (make_buckets,
    already checked) and `sizes` their element counts. The first finding, or None."""
    ends = [i for i, e in enumerate(events) if e[0] == "window end"]
    windows = [events[start + 1:end] for start, end in zip([-1] + ends, ends)]
    for w, window in enumerate(windows, start=1):
        wrong = window_problem(window, w, buckets, sizes, sync_at_forward)
        if wrong:
            return f"window {w}: {wrong}"
    if len(windows) != lab.WINDOWS:
        return f"{len(windows)} windows trained, expected {lab.WINDOWS}"
    return None


def window_problem(window: list, w: int, buckets: list, sizes: list[int], sync_at_forward: list) -> str | None:
    accum, n_buckets = lab.ACCUM, len(buckets)
    micro, segments = [], []  # the window's micro-batches: each starts with a forward
    for event in window:
        if event[0] == "forward" and micro:
            segments.append(micro)
            micro = []
        micro.append(event)
    segments.append(micro)
    if len(segments) != accum:
        return f"{len(segments)} forward passes, expected {accum} micro-batches"
    early = sum(e[0] == "launch" for s in segments[:-1] for e in s)
    # sync as the forward found it (a pre-hook on the model), not as the learner's forward set its flag
    at = (w - 1) * accum
    synced = [k for k in range(accum - 1) if at + k < len(sync_at_forward) and sync_at_forward[at + k][0]]
    during = f"{early} all-reduces during the first {accum - 1} micro-batches"
    waste = f"reducing during accumulation wastes {accum - 1} of every {accum} communications"
    if early and synced:  # DDP decides at the forward: a forward with sync on makes its backward reduce
        k = synced[0]
        if sync_at_forward[at + k][1]:  # inside the learner's no_sync() block, yet sync was on
            return (f"{during}: the forward of micro-batch {k} ran inside no_sync() with sync still on - {waste}: "
                    f"no_sync() must turn sync off for its block (and on again after it)")
        return (f"{during}: the forward of micro-batch {k} ran with sync on (outside no_sync()), so its backward "
                f"reduces, as DDP's would - in train_window run each accumulating micro-batch's forward AND "
                f"backward inside `with model.no_sync():`")
    if early:
        return f"{during} - {waste}: inside no_sync() the hook must do nothing"
    last = segments[-1]
    launches, readies, waits, steps = ([i for i, e in enumerate(last) if e[0] == kind]
                                       for kind in ("launch", "ready", "wait", "step"))
    blocking = [i for i in waits if last[i][1] in BLOCKING]
    if len(launches) != n_buckets:
        hint = (" - the last backward of a window must run outside no_sync(), with sync on again"
                if not launches and w == 1 else
                " - does the hook start again from bucket 0 in every window (is all of its state reset after each "
                "window)?" if w > 1 else "")
        return f"{len(launches)} all-reduces on the last micro-batch, expected one per bucket ({n_buckets}){hint}"
    if blocking and readies and blocking[0] < readies[-1]:
        return ("waited for an all-reduce while gradients were still arriving - waiting inside the hook stalls "
                "backward; keep the Work and wait in finish_gradient_sync()")
    if launches[0] > readies[-1]:
        return late_window(last, w, sync_at_forward)
    launched = [last[i][1] for i in launches]
    if launched != sizes:
        return (f"the all-reduces had {launched} elements, but the buckets in index order have {sizes}: "
                f"all-reduce each bucket as one buffer, bucket 0 first")
    for k, i in enumerate(launches):
        arrived = {e[1] for e in last[:i] if e[0] == "ready"}
        early = [index for index in buckets[k] if index not in arrived]
        if early and any(e[0] == "ready" for e in last[i:]):  # launched during backward, too soon
            return (f"bucket {k} was all-reduced before the gradient(s) of its parameter(s) {early} had arrived - "
                    f"a bucket is complete only once every gradient it holds is ready: count each gradient in the "
                    f"bucket that holds it")
    if len(waits) != n_buckets:
        return (f"{len(waits)} of the window's {n_buckets} all-reduces were seen to finish (by a wait, a future's "
                f"wait or value, or a callback) - "
                + ("never waited: wait for every pending all-reduce before the step" if not waits else
                   "forget the all-reduces already waited on after each window (empty the pending list)"))
    if not steps:
        return "optimizer.step() was never called at the end of the window"
    if steps[0] < waits[-1]:
        return ("the optimizer stepped before every all-reduce had finished - call finish_gradient_sync() before "
                "optimizer.step()")
    return None


def late_window(last: list, w: int, sync_at_forward: list) -> str:
    """Why every all-reduce of window `w` started after its last gradient was ready."""
    if not last[0][1]:  # the last forward ran with sync off: only finish_gradient_sync launched
        k = w * lab.ACCUM - 1  # that forward, in sync_at_forward
        outside = k < len(sync_at_forward) and not sync_at_forward[k][1]
        return ("the last micro-batch's forward ran with sync off, so its backward launched nothing - "
                + ("it ran outside no_sync(), which left sync off after its block: no_sync() must leave the model "
                   "with sync on again when its block ends (try/finally)" if outside else
                   "the last forward and backward of a window must run outside no_sync(), with sync on again"))
    if w > 1:
        return ("every all-reduce started after backward ended, though window 1's overlapped - is what the hook "
                "counts (gradients arrived per bucket) reset after each window?")
    return ("every all-reduce started after the last gradient was ready - nothing overlaps backward: launch a "
            "bucket from the hook as soon as all of its gradients have arrived (and its turn has come) - is each "
            "gradient counted in the bucket that holds it?")


def contents_problem(events: list, buckets: list, local: list, world_size: int) -> str | None:
    """What each all-reduce of window 1 carried: bucket k's gradients accumulated over the window on
    this rank (`local`), in any order, or those divided by the world size (DDP divides first)."""
    launched = [e[3] for e in events[:[e[0] for e in events].index("window end")] if e[0] == "launch"]
    for k, (sent, bucket) in enumerate(zip(launched, buckets)):
        want = torch.cat([local[i].reshape(-1) for i in bucket]).sort().values
        got = sent.reshape(-1).sort().values.to(want.device)
        if not any(torch.allclose(got, w, rtol=1e-5, atol=1e-7) for w in (want, want / world_size)):
            return (f"window 1: the all-reduce of bucket {k} did not carry this rank's gradients of parameters "
                    f"{bucket} (summed over the window's micro-batches) - fill the buffer from their .grad tensors "
                    f"at launch, zeros for a missing one")
    return None


def gradients_problem(names: list[str], mine: list, reference: list, local: list, world_size: int) -> str | None:
    """The first window's gradients, parameter by parameter, against DDP's."""
    # Tolerance: the same sums in another order and division before/after the sum differ by float32
    # rounding (relative 1e-6); the mistakes (x2, /2, a rank's own gradient) are off by 30% or more.
    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-6)

    if len(mine) != len(reference):
        return "no gradients were seen before the first optimizer step"
    for name, g, ref, own in zip(names, mine, reference, local):
        if g is None:
            return f"{name}.grad is None before the step - was backward run?"
        if not torch.isfinite(g).all():
            return f"{name}.grad holds NaN or inf before the first step"
        if close(g, ref):
            continue
        if close(g * world_size, ref):
            return (f"{name}.grad is {world_size}x too small - divided by world_size twice (before and after the "
                    f"all-reduce?)")
        if close(g, ref * world_size):
            return f"{name}.grad is {world_size}x too large - the sum was never divided by the world size"
        if close(g, own):
            return (f"{name}.grad is still this rank's own gradient - the averaged buffer was never copied back "
                    f"into .grad (or this parameter is never reduced)")
        return (f"{name}.grad differs from DDP's by {max_diff(g, ref):.2e} before the first step (tolerance "
                    f"rtol 1e-4) - check the flatten/copy-back offsets, and that no bucket buffer is changed "
                    f"(divided) before its work.wait() returns")
    return None


def weights_problem(model: nn.Module, reference: torch.Tensor) -> str | None:
    mine = flat_params(model)
    copies = all_gather_tensor(mine.to(next(model.parameters()).device))
    if any(max_diff(mine, copy.cpu()) > 0 for copy in copies):
        return f"after {lab.WINDOWS} steps the weights differ between ranks - some gradient is not averaged on every " \
               "rank"
    # Tolerance: DDP divides before its all-reduce, we divide after, and the sums run in another
    # order: float32 rounding of about 1e-7 per step (7e-9 measured here after 4 steps), so 1e-5 is
    # generous; a missing zero_grad or a stale bucket moves the weights by more than 1e-3.
    gap = max_diff(mine, reference)
    if gap > 1e-5:
        return (f"after {lab.WINDOWS} steps the weights differ from DDP's by {gap:.2e} (tolerance 1e-5), although "
                f"the first window's gradients matched - are the gradients zeroed after each step, and does each "
                f"window start with no all-reduce left over from the last?")
    return None


class Probe(nn.Module):
    """A model unlike the lab's: its layers are registered in another order than they are used, one
    bias is frozen, one layer is never used, and a BatchNorm has buffers. Each rank builds it from
    its own seed, so only the broadcast at the start makes the ranks agree."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.late = nn.Linear(8, 3)    # used second
        self.early = nn.Linear(5, 8)   # used first
        self.norm = nn.BatchNorm1d(8)
        self.spare = nn.Linear(3, 3)   # never used: it gets no gradient
        self.early.bias.requires_grad_(False)

    def forward(self, x):
        return self.late(torch.tanh(self.norm(self.early(x))))


PROBE_CAP = 10  # elements: four buckets, the first (spare's) never complete during backward


class OutOfOrder(nn.Module):
    """Every parameter used, layers registered in another order than used: backward makes bucket 1
    (`x`) complete first, then bucket 0 (`y`), whose launch gives bucket 1 its turn while `z`'s
    gradients are still to come. Buckets of 24, 10 and 20 elements at a cap of 10."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.z = nn.Linear(3, 5)   # used first: its gradients come last (bucket 2)
        self.x = nn.Linear(4, 2)   # used last: its gradients come first (bucket 1)
        self.y = nn.Linear(5, 4)   # used second (bucket 0)

    def forward(self, inputs):
        return self.x(torch.tanh(self.y(torch.tanh(self.z(inputs)))))


def late_launches(events: list, buckets: list[list[int]]) -> str:
    """The contract's "as soon as all of its gradients have arrived - but never before every
    lower-numbered bucket", as an effect: each bucket's all-reduce must start before the next
    gradient arrives (or backward ends) after the moment its turn came. "" if so."""
    ready = {e[1]: i for i, e in enumerate(events) if e[0] == "ready"}
    launches = [i for i, e in enumerate(events) if e[0] == "launch"]
    end = next(i for i, e in enumerate(events) if e[0] == "backward end")
    turn = -1
    for k, bucket in enumerate(buckets):
        if any(i not in ready for i in bucket) or k >= len(launches):
            return ""  # a bucket that never completed: finish_gradient_sync launches it (checked elsewhere)
        turn = max(turn, *(ready[i] for i in bucket))
        deadline = next((i for i, e in enumerate(events) if i > turn and e[0] == "ready"), end)
        if launches[k] > deadline:
            came = events[deadline]
            return (f"bucket {k}'s turn came when the gradient of parameter {events[turn][1]} arrived, but it was "
                    f"all-reduced only after " + (f"the gradient of parameter {came[1]} arrived" if came[0] == "ready"
                                                  else "backward ended")
                    + f" - a bucket that completed out of order must go out as soon as the buckets before it have: "
                      f"when one bucket is launched, launch every following bucket that is already complete")
    return ""


def ddp(module: nn.Module, me: Rank, **options) -> DDP:
    """torch's DDP around `module`, moved to this rank's device."""
    return DDP(module.to(me.device), device_ids=[me.device.index] if me.device.type == "cuda" else None, **options)


def probe_input(me: Rank) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(me.rank)).to(me.device)


def probe_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    if isinstance(model, lab.HandDDP):
        model.finish_gradient_sync()


def check_out_of_order(checks: Checks, me: Rank) -> bool:
    """HandDDP on OutOfOrder against DDP: when each bucket goes out during backward, and the
    averaged gradients."""
    x = probe_input(me)[:, :3]
    reference = ddp(OutOfOrder(seed=2000 + me.rank), me)
    probe_step(reference, x)
    model = OutOfOrder(seed=2000 + me.rank).to(me.device)
    events: list = []
    record_gradient_ready(model, events)
    with recording_all_reduce(events):
        hand = lab.HandDDP(model, bucket_cap=PROBE_CAP)
        events.clear()  # the broadcasts of the start are no all-reduces; only backward's events count
        hand(x).square().mean().backward()
        events.append(("backward end",))
        hand.finish_gradient_sync()
    buckets = lab.make_buckets(list(model.parameters()), PROBE_CAP)
    late = late_launches(events, buckets)
    if late:
        return checks.expect(False, f"rank {me.rank}: on a model whose layers are registered in another order than "
                                    f"used, {late}")
    for (name, mine), theirs in zip(model.named_parameters(), reference.module.parameters()):
        if mine.grad is None or not torch.allclose(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6):
            return checks.expect(False, f"rank {me.rank}: on a model whose layers are registered in another order than "
                                        f"used, {name}.grad differs from DDP's - is every bucket all-reduced once and "
                                        "copied back?")
    return checks.expect(True, "")


def check_probe(checks: Checks, me: Rank) -> bool:
    """HandDDP on the Probe against DDP(find_unused_parameters=True): which all-reduces go out and
    in what order, the averaged gradients (a parameter nobody used: zeros for us, None for DDP),
    and where no_sync() is decided."""
    x = probe_input(me)
    reference = ddp(Probe(seed=1000 + me.rank), me, find_unused_parameters=True)
    probe_step(reference, x)
    model = Probe(seed=1000 + me.rank).to(me.device)
    events: list = []
    try:
        with recording_all_reduce(events):
            hand = lab.HandDDP(model, bucket_cap=PROBE_CAP)
            probe_step(hand, x)
    except AttributeError as error:  # the same on every rank: the same parameter is unused everywhere
        if "'NoneType'" not in str(error):
            raise
        return checks.expect(False, f"rank {me.rank}: on a model with a layer forward never uses, {error}: that "
                                    "layer's .grad is None - it counts as zeros in its bucket, and gets the averaged "
                                    "slice as a new .grad")
    launched = [e[1] for e in events if e[0] == "launch"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    sizes = [sum(trainable[i].numel() for i in bucket) for bucket in lab.make_buckets(trainable, PROBE_CAP)]
    if len(launched) < len(sizes):
        missing = [b for b, size in enumerate(sizes) if size not in launched]
        return checks.expect(False, f"rank {me.rank}: on a model with a layer forward never uses, bucket(s) {missing} "
                                    f"of {len(sizes)} were never all-reduced: a parameter that gets no gradient never "
                                    "makes its bucket complete (nor, in order, the ones after it) - "
                                    "finish_gradient_sync() must launch the buckets still waiting, counting a missing "
                                    "gradient as zeros")
    if launched != sizes:
        return checks.expect(False, f"rank {me.rank}: buckets were all-reduced in the order of their sizes {launched}, "
                                    f"but the buckets in index order have sizes {sizes}: launch bucket i only after "
                                    "buckets 0..i-1, even when a later one completes first - every rank must issue its "
                                    "all-reduces in the same order (NCCL hangs or mixes buckets up otherwise)")
    for (name, mine), theirs in zip(model.named_parameters(), reference.module.parameters()):
        if not mine.requires_grad:
            continue
        want = theirs.grad if theirs.grad is not None else torch.zeros_like(theirs)
        if mine.grad is None or not torch.allclose(mine.grad, want, rtol=1e-4, atol=1e-6):
            return checks.expect(False, f"rank {me.rank}: on a model with a frozen bias, an unused layer and a "
                                        f"BatchNorm, {name}.grad differs from DDP's - is every bucket's average copied "
                                        "back, also into a parameter whose .grad was None?")
    # no_sync is decided at the forward: a forward inside it makes the backward local, as in DDP
    events.clear()
    with recording_all_reduce(events):
        plain = lab.HandDDP(nn.Linear(5, 3).to(me.device))
        with plain.no_sync():
            loss = plain(x).square().mean()
        loss.backward()
    launches = sum(e[0] == "launch" for e in events)
    if not checks.expect(launches == 0, f"rank {me.rank}: a forward inside no_sync() and its backward outside it "
                                        f"launched {launches} all-reduce(s); DDP launches none - it decides at the "
                                        f"forward. The hook must obey self.reduce_this_backward, which forward() "
                                        f"sets, not self.sync"):
        return False
    # no_sync() ends however its block ends: after an exception inside it, backward reduces again
    events.clear()
    with recording_all_reduce(events):
        plain = lab.HandDDP(nn.Linear(5, 3).to(me.device))
        try:
            with plain.no_sync():
                raise KeyboardInterrupt  # what a learner's Ctrl-C, or any error, does to the block
        except KeyboardInterrupt:
            pass
        plain(x).square().mean().backward()
        during_backward = sum(e[0] == "launch" for e in events)
        plain.finish_gradient_sync()
    return checks.expect(during_backward > 0, f"rank {me.rank}: after an exception inside no_sync(), the next "
                                              f"backward launched no all-reduce: no_sync() must turn sync back on "
                                              f"however its block ends (in a finally:)")


def reference_run(me: Rank, windows: list) -> tuple[list, list, torch.Tensor]:
    """torch's DDP on the same micro-batches, with its own no_sync, in a loop of the check's own:
    its first-window gradients, this rank's own (un-averaged) first-window gradients, and its
    weights after training."""
    model = ddp(lab.make_model(), me)
    optimizer = torch.optim.SGD(model.parameters(), lr=lab.LR)
    loss_fn = nn.CrossEntropyLoss()
    grads = []
    for w, micro_batches in enumerate(windows):
        for m, (x, y) in enumerate(micro_batches):
            with model.no_sync() if m < len(micro_batches) - 1 else nullcontext():
                (loss_fn(model(x.to(me.device)), y.to(me.device)) / len(micro_batches)).backward()
        if w == 0:
            grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()

    local = lab.make_model().to(me.device)  # no communication at all: this rank's own gradients
    for x, y in windows[0]:
        (loss_fn(local(x.to(me.device)), y.to(me.device)) / len(windows[0])).backward()
    return grads, [p.grad for p in local.parameters()], flat_params(model.module)


def main(me: Rank, checks: Checks) -> None:
    windows = lab.rank_micro_batches(me.rank, me.world_size)
    ref_grads, own_grads, ref_weights = reference_run(me, windows)

    model = lab.make_model().to(me.device)
    names = [name for name, _ in model.named_parameters()]
    events: list = []
    record_gradient_ready(model, events)
    params = [p for p in model.parameters()]
    buckets = lab.make_buckets(params, lab.BUCKET_CAP)
    if not check_buckets(checks, params, buckets):
        return
    hand = lab.HandDDP(model)
    # (model.sync, inside the no_sync() block?) when each forward began: DDP decides at the forward
    sync_at_forward: list = []
    inside = [False]
    learners_no_sync = hand.no_sync

    @contextmanager
    def watched_no_sync():
        with learners_no_sync():
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    hand.no_sync = watched_no_sync
    hand.register_forward_pre_hook(
        lambda module, args: sync_at_forward.append((getattr(module, "sync", None), inside[0])))
    sizes = [sum(params[i].numel() for i in bucket) for bucket in buckets]
    print0(f"{len(params)} parameters in {len(buckets)} buckets: {buckets}")
    grads = []

    def grab():
        grads.extend(None if p.grad is None else p.grad.detach().clone() for p in model.parameters())
    buffers: list = []  # weak references to every launched buffer
    raced: list = []  # buckets whose buffer was changed while its all-reduce was in flight
    try:
        with recording_all_reduce(events, buffers, raced):
            lab.train(hand, windows, me.device, events=events, after_first=grab)
    finally:  # also when it raised: a blocking all_reduce returns no Work to wait on
        check_async(checks, events, me.rank)
    if raced:  # whatever the timing: its effect on the sums depends on who got there first
        checks.fail(f"rank {me.rank}: the buffer of a bucket of {raced[0]} elements was changed (divided?) after its "
                    f"all-reduce was launched and before its work.wait() returns: what the ranks sum is then "
                    f"whatever the race left - change it only after the wait (or before the launch)")
        return
    gc.collect()
    kept = len({id(b()) for b in buffers if b() is not None})
    # The gradients are compared only when the order of events is right: a step taken before the
    # wait, say, would also show up as wrong gradients, and the first finding is the one to fix.
    wrong = (events_problem(events, buckets, sizes, sync_at_forward)
             or contents_problem(events, buckets, own_grads, me.world_size)
             or gradients_problem(names, grads, ref_grads, own_grads, me.world_size))
    if wrong:
        checks.fail(f"rank {me.rank}: {wrong}")
    else:
        wrong = weights_problem(model, ref_weights)
        checks.expect(wrong is None, wrong or "")
        checks.expect(kept <= len(buckets), f"rank {me.rank}: after {lab.WINDOWS} windows, {kept} buffers of "
                                            f"launched all-reduces are still held, where one per bucket "
                                            f"({len(buckets)}) is all a window needs - memory grows with every "
                                            f"window: forget the all-reduces already waited on after each window "
                                            f"(empty the pending list)")
    if checks.passed:  # right on the lab's model: now on ones unlike it
        if check_probe(checks, me):
            check_out_of_order(checks, me)
    if checks.passed:
        check_on_gpu(checks, me, windows[0])
    launches = sum(e[0] == "launch" for e in events)
    print0(f"{lab.WINDOWS} steps of {lab.ACCUM} micro-batches: {launches} all-reduces on rank 0 "
           f"({len(buckets)} per step; without no_sync, {lab.ACCUM * len(buckets)} per step)")
    print0(f"(torch's DDP launches {1 + (lab.WINDOWS - 1) * len(buckets)} for the same schedule with {len(buckets)} "
           f"buckets, as in chapter 12's check-yourself: its first communicating backward puts every gradient in "
           f"one bucket and only then rebuilds, while HandDDP has its buckets from the start)")


def check_on_gpu(checks: Checks, me: Rank, window: list) -> bool:
    """One window of HandDDP run again as on a GPU machine (ringside.effects.on_rank_gpu): the model on
    this rank's stand-in GPU; what its buckets hand the all-reduces, and the gradients, stay there."""
    def run(device: torch.device):
        hand = lab.HandDDP(lab.make_model().to(device))
        lab.train(hand, [window], device, events=[], after_first=lambda: None)
        return list(hand.parameters())

    problem, note = on_rank_gpu("HandDDP", run, lab.HandDDP, lab.train, what="a parameter")
    if note:
        print0(note)
    return checks.agree(problem)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 12 (ddp_internals)")
