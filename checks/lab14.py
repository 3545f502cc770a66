"""The check of lab 14 (debugging): it runs the code of labs/14_debugging.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).

Two modes. Without arguments it runs the three fixed jobs under TORCH_DISTRIBUTED_DEBUG=DETAIL
(so that mismatched collectives fail at once, not after a timeout), keeps a count of each rank's
collectives and, when a job fails, tells every rank where the others were (through the group's
store, which still works when a collective has broken the group). With `--broken jobN` it runs
that job as it was handed over, with the tools of chapter 14 on, and says where to look.
"""

from __future__ import annotations

import dataclasses

import faulthandler
import hashlib
import inspect
import json
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder
from ringside.effects import on_rank_gpu
from ringside.lab import ranks_label
from ringside.launch import ROOT
from ringside.runtime import finish

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()

TIMEOUT = timedelta(seconds=10)  # the fixed jobs' collectives (and --broken job2, job3)
BROKEN_TIMEOUT = {"job1": timedelta(seconds=120), "job2": TIMEOUT, "job3": TIMEOUT}  # time to look
DUMP_AFTER = 5.0  # --broken: seconds until each rank writes its stack and flight recorder to files
LAB_FILE = "14_debugging.py"


# --- The references: each fixed job in one process ------------------------------------------------


def reference_job1(world_size: int, target: float) -> tuple[torch.Tensor, int]:
    """Every rank's step simulated in one process: the shards' batch losses, the loop ended at the
    first step whose mean loss is below `target`, else the shards' gradients averaged."""
    x, y = lab.training_data(torch.device("cpu"))
    shards = [(x[r::world_size], y[r::world_size]) for r in range(world_size)]
    w, updates = lab.new_weights(torch.device("cpu")), 0
    for step in range(lab.MAX_STEPS):
        start = step * lab.BATCH % (lab.N_TRAIN // world_size)
        losses = [lab.batch_loss(w, xs[start:start + lab.BATCH], ys[start:start + lab.BATCH]) for xs, ys in shards]
        if sum(loss.item() for loss in losses) / world_size < target:
            break
        grads = [torch.autograd.grad(loss, w)[0] for loss in losses]
        with torch.no_grad():
            w -= lab.LR * torch.stack(grads).mean(dim=0)
        updates += 1
    return w.detach(), updates


def reference_job2(world_size: int, device: torch.device) -> tuple[float, float]:
    """The mean squared error over all 1001 samples: the chunks' float32 squared errors (computed on
    the ranks' device, as they do) added up in float64, and everything in float64 (also accepted)."""
    x, y, w = lab.validation_data(device)
    errors = torch.cat([((xc @ w - yc) ** 2).flatten() for xc, yc in zip(x.chunk(world_size), y.chunk(world_size))])
    exact = ((x.double() @ w.double() - y.double()) ** 2).mean().item()
    return errors.double().sum().item() / errors.numel(), exact


def reference_job3(world_size: int, bad: float = float("nan")) -> torch.Tensor:
    """Every rank's step simulated in one process: the shards' gradients averaged, and a step
    skipped by all when any shard's batch loss is not finite (`bad`: how the bad labels read)."""
    x, y = lab.training_data(torch.device("cpu"), corrupt=True)
    y = torch.where(torch.isnan(y), torch.full_like(y, bad), y)
    shards = [(x[r::world_size], y[r::world_size]) for r in range(world_size)]
    w = lab.new_weights(torch.device("cpu"))
    for start in range(0, lab.N_TRAIN // world_size, lab.BATCH):
        losses = [lab.batch_loss(w, xs[start:start + lab.BATCH], ys[start:start + lab.BATCH]) for xs, ys in shards]
        if not all(torch.isfinite(loss) for loss in losses):
            continue
        grads = [torch.autograd.grad(loss, w)[0] for loss in losses]
        with torch.no_grad():
            w -= lab.LR * torch.stack(grads).mean(dim=0)
    return w.detach()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float32 sums in another order (shards, then all_reduce): 1e-5 relative is ample
    return a.shape == b.shape and torch.allclose(a.cpu().double(), b.cpu().double(), rtol=1e-5, atol=1e-6)


# --- Where each rank is: its collectives counted, and shared through the store --------------------

def lab_frames(frames) -> str:
    """The two innermost lines of the lab (or solution) file among `frames`: "line 81 (f) <- line 95 (g)"."""
    ours = [f for f in frames if f.filename.endswith(LAB_FILE) and f.name != "<module>"][-2:]
    return " <- ".join(f"line {f.lineno} ({f.name})" for f in reversed(ours)) or "an unknown line"


def lab_line() -> str:
    return lab_frames(traceback.extract_stack())


def where(error: BaseException) -> str:
    return lab_frames(traceback.extract_tb(error.__traceback__))


@contextmanager
def counted():
    """This rank's collectives in one job, recorded (ringside.calls) with the lab's line that called each."""
    with Recorder(on_call=lambda call: call.update(where=lab_line())) as recorder:
        yield recorder


def in_flight(recorder) -> dict | None:
    """The collective this rank is in (its last, not returned), as the other ranks are told of it."""
    if not recorder.calls or recorder.calls[-1].completed:
        return None
    call = recorder.calls[-1]
    return {"n": len(recorder.calls), "op": call.op, "where": call.where,
            "shape": str(list(call.tensors[0].shape)) if call.tensors else "objects"}


def store():
    return dist.distributed_c10d._get_default_store()


def post(phase: str, rank: int, state: dict) -> None:
    try:
        store().set(f"lab14/{phase}/{rank}", json.dumps(state))
    except Exception:  # no store: each rank speaks for itself
        pass


def wait_for_the_others(phase: str, world_size: int, seconds: float) -> dict[int, dict]:
    """The states the ranks posted for `phase`, waiting up to `seconds` for all of them."""
    states, deadline = {}, time.monotonic() + seconds
    try:
        while True:
            for rank in range(world_size):
                key = f"lab14/{phase}/{rank}"
                if rank not in states and store().check([key]):
                    states[rank] = json.loads(store().get(key))
            if len(states) == world_size or time.monotonic() > deadline:
                return states
            time.sleep(0.05)
    except Exception:
        return states


def describe(state: dict, job: str) -> str:
    if state["kind"] == "returned":
        return f"returned from {job} after {state['count']} collectives"
    if state["kind"] == "collective":
        raised = f", which raised {state['error']}" if state.get("error") else ""
        return f"was in collective #{state['n']}, {state['op']} of {state['shape']} at {state['where']}{raised}"
    return f"raised {state['error']}"


FEWER = {  # a rank returned while others waited in a collective: what that means in each job
    "job1": "a rank that leaves the loop alone leaves the others waiting: every rank must end the loop at "
            "the same step, on a value that every rank shares",
    "job2": "every rank must call the same collectives",
    "job3": "a rank that skips a step alone calls fewer collectives than the others: every rank must "
            "skip together",
}


def parted_ways(job: str, states: dict[int, dict], world_size: int) -> str:
    """Where every rank was when the job failed, grouped, and what that suggests."""
    groups: dict[str, list[int]] = {}
    for rank in range(world_size):
        if rank in states:
            text = describe(states[rank], job)
        else:
            text = "sent no news (its process may have died)"
        groups.setdefault(text, []).append(rank)
    said = "; ".join(f"{ranks_label(ranks)} {'were' + text[3:] if len(ranks) > 1 and text.startswith('was') else text}"
                     for text, ranks in groups.items())
    kinds = [s["kind"] for s in states.values()]
    inside = [s for s in states.values() if s["kind"] == "collective"]
    if "raised" in kinds or any(s.get("error") for s in inside):
        hint = ("read that error: it came first, the other ranks only waited" if len(set(kinds)) > 1
                else "read that error")
    elif "returned" in kinds and inside:
        hint = FEWER[job.split("_")[0]]
    elif len({(s["op"], s["shape"], s["where"]) for s in inside}) > 1:
        if {s["op"] for s in inside} == {"all_gather"} and len({s["shape"] for s in inside}) > 1:
            hint = ("all_gather needs tensors of one shape on every rank: an all_gather of chunks of "
                    "unequal sizes")
        else:
            hint = ("the ranks called different collectives at the same point: one of them is in a "
                    "branch that not every rank takes (an `if me.is_main`, a test on this rank's own data)")
    else:
        hint = "every rank waits in the same collective: did a rank miss an earlier one?"
    return f"{job} failed, the ranks parted ways: {said} - {hint}"


def run_fixed(job, me: Rank, checks: Checks):
    """Run a fixed job, counting its collectives. If it fails here, say where every rank was."""
    try:
        with counted() as recorder:
            result = job(me)
    except NotImplementedError:
        raise
    except Exception as error:
        if in_flight(recorder) is not None:
            state = {"kind": "collective", **in_flight(recorder)}
            if not re.search(r"timed out|timeout|monitoredBarrier|mismatch between collectives|closed|reset by peer",
                             f"{type(error).__name__} {error}", re.IGNORECASE):  # not a waiting rank's error
                state["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:120]}"
        else:
            state = {"kind": "raised", "error": f"{type(error).__name__}: {' '.join(str(error).split())[:120]} "
                                                f"at {where(error)}"}
        post(job.__name__, me.rank, state)
        # the others fail at once too, or time out waiting for this rank: wait for their news as long
        states = wait_for_the_others(job.__name__, me.world_size, seconds=TIMEOUT.total_seconds() + 5)
        checks.fail(parted_ways(job.__name__, states, me.world_size))
        return False, None
    post(job.__name__, me.rank, {"kind": "returned", "count": len(recorder.calls)})
    return True, result


def everyone_returned(job, me: Rank, checks: Checks) -> bool:
    """Wait until every rank has left `job` (a rank stuck in a collective times out). When some did
    not return, this rank's result means nothing: say, as they do, where every rank was."""
    states = wait_for_the_others(job.__name__, me.world_size, seconds=3 * TIMEOUT.total_seconds() + 10)
    if len(states) == me.world_size and all(s["kind"] == "returned" for s in states.values()):
        return True
    checks.fail(parted_ways(job.__name__, states, me.world_size))
    return False


# --- The checks of the fixed jobs -----------------------------------------------------------------


def check_job1(me: Rank, checks: Checks, result) -> None:
    try:
        w, updates = result
        updates = int(updates)
    except (TypeError, ValueError):
        checks.fail(f"job1_fixed returned {result!r}, expected (weights, number of updates)")
        return
    ref_w, ref_updates = reference_job1(me.world_size, lab.TARGET_LOSS)
    if updates != ref_updates:
        _, on_the_sum = reference_job1(me.world_size, lab.TARGET_LOSS / me.world_size)
        if updates == on_the_sum:
            hint = ("that is where the sum of the ranks' losses falls below TARGET_LOSS: the all_reduce "
                    "adds them, divide by world_size for their mean")
        else:
            hint = ("the loop must end at the first step whose loss, the mean over the ranks, is below "
                    "TARGET_LOSS, before that step's update, on every rank")
        checks.fail(f"job1_fixed: {updates} updates, expected {ref_updates} - {hint}")
    elif torch.isnan(w).any() or not close(w, ref_w):
        checks.fail("job1_fixed: the weights differ from the reference after the right number of "
                    "updates - change only where the loop ends, not the training step")
    else:
        checks.expect(True, "")


def check_job2(me: Rank, checks: Checks, mse) -> None:
    if not isinstance(mse, float):
        checks.fail(f"job2_fixed returned {type(mse).__name__}, expected a float (use .item())")
        return
    want, exact = reference_job2(me.world_size, me.device)
    if any(abs(mse - v) <= 1e-10 * abs(v) for v in (want, exact)):
        checks.expect(True, "")
        return
    x, y, w = lab.validation_data(torch.device("cpu"))
    chunks = [((xc @ w - yc) ** 2).double() for xc, yc in zip(x.chunk(me.world_size), y.chunk(me.world_size))]
    mean_of_means = sum(c.mean().item() for c in chunks) / me.world_size
    mine = chunks[me.rank].mean().item()
    tolerance = 1e-6 * want
    if mse != mse:
        hint = ("NaN - uninitialized values entered the mean: was it an all_gather of chunks of "
                "unequal sizes? (all_gather needs one shape on every rank)")
    elif abs(mse - mean_of_means) <= tolerance:
        hint = "that is the mean of the ranks' means: the chunks have unequal sizes, so add sums and counts"
    elif abs(mse - mine) <= tolerance:
        hint = "that is this rank's own chunk only: combine the ranks' results with a collective"
    elif abs(mse - want) <= 1e-5 * want:
        hint = (f"{abs(mse - want) / want:.0e} off, float32 precision: add up the sums and counts in "
                f"float64, which keeps 1e-10")
    else:
        hint = ("did padding, a wrong count or an all_gather of chunks of unequal sizes enter the "
                "mean? divide the total sum by 1001")
    checks.fail(f"job2_fixed: the mean squared error is {mse:.10f}, expected {want:.10f} - {hint}")


@contextmanager
def bad_labels_read_as(bad: float):
    """The instrument's out-of-range readings recorded as `bad` (inf) instead of NaN, for the lab's
    own code: training_data is replaced in the lab's globals, so every path to it sees them."""
    names = lab.job3_fixed.__globals__
    original = names["training_data"]

    def training_data(device, corrupt=False):
        x, y = original(device, corrupt)
        return x, (torch.where(torch.isnan(y), torch.full_like(y, bad), y) if corrupt else y)

    names["training_data"] = training_data
    try:
        yield
    finally:
        names["training_data"] = original


def job3_fixed_with_inf_labels(me: Rank):
    """job3_fixed on data whose bad labels read inf: its loss is inf, not NaN, and the step must be
    skipped all the same ("not finite", the TODO says)."""
    with bad_labels_read_as(float("inf")):
        return lab.job3_fixed(me)


def check_job3(me: Rank, checks: Checks, w, bad: float = float("nan")) -> None:
    """The weights against the reference that skips, on every rank, each step whose loss is not finite
    (`bad`: how the bad labels read)."""
    want = reference_job3(me.world_size, bad)
    as_inf = "with the bad labels recorded as inf instead of NaN, " if bad == float("inf") else ""
    if not isinstance(w, torch.Tensor):
        checks.fail(f"job3_fixed returned {type(w).__name__}, expected the weights")
    elif as_inf and not torch.isfinite(w).all():
        checks.fail(f"job3_fixed: {as_inf}the loss is inf and the weights end up inf or NaN - that step was not "
                    f"skipped: test the loss with torch.isfinite (inf and NaN), not torch.isnan")
    elif torch.isnan(w).any():
        checks.fail("job3_fixed: the weights hold NaN - the step with the corrupt sample was not "
                    "skipped on every rank")
    elif as_inf:
        checks.expect(close(w, want), f"job3_fixed: {as_inf}the weights differ from the reference that skips, on "
                                      f"every rank, the one step whose loss is not finite")
    elif not close(w, want):
        checks.fail("job3_fixed: the weights differ from the reference that skips, on every rank, "
                    "the one step in which some rank's loss is not finite - did a rank skip alone, "
                    "or did every rank skip more than that step?")
    else:
        checks.expect(True, "")


# --- The diagnoses --------------------------------------------------------------------------------


def fingerprint(*parts) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


# The answers, kept as fingerprints (job, world size, rank) and (job, line) so that reading the
# check does not give them away. Where the line is an `if`, its condition and the line it guards
# are both accepted (the lab's diagnose says so).
FAULT_RANKS = {"145ce290f9e60f15", "4c2227440ae454a4", "4e90027415d8af94", "8078e636861558c2",
               "a3a8bf0e25ae1bc1", "db64ff32a9cbe2f5", "ddbb76a1bcaeaac3", "f34ccf7a756c25ba",
               "f4266f49d2a05d7f"}
FAULT_LINES = {"job1": {"8edc276ae6bd4509", "df41719300f5bf7e"},
               "job2": {"a296c32b6a7938a6"},
               "job3": {"5311414388c0de77", "ede296f9ac1e41b0"}}
HOW_TO_FIND = {
    "job1": ("job1_broken", "which rank is not where the others are? Run --broken job1 at this number of "
                            "ranks and read runs/lab14/job1/ side by side: each rank's stack and the flight "
                            "recorder's last sequence numbers"),
    "job2": ("job2_broken", "whose collective differs from the others'? --broken job2 runs under "
                            "TORCH_DISTRIBUTED_DEBUG=DETAIL, which prints each rank's collective and shape"),
    "job3": ("job3_broken", "which rank failed first, and why? Under --broken job3 the others only "
                            "wait for it: look for the first error that is not a timeout"),
}


def normalized(line) -> str:
    return " ".join(str(line).split())


def check_diagnoses(me: Rank, checks: Checks) -> None:
    found = lab.diagnose(me.world_size)
    if not isinstance(found, dict):
        checks.fail(f"diagnose returned {type(found).__name__}, expected a dict with keys job1, job2, job3")
        return
    for job, (broken_name, hint) in HOW_TO_FIND.items():
        broken = getattr(lab, broken_name)
        entry = found.get(job)
        if not isinstance(entry, dict) or not {"rank", "line", "cause"} <= set(entry):
            checks.fail(f"diagnosis of {job}: expected {{'rank': ..., 'line': ..., 'cause': ...}}, got {entry!r}")
            continue
        source = {normalized(line) for line in inspect.getsource(broken).splitlines()}
        line = normalized(entry["line"])
        if fingerprint(job, me.world_size, entry["rank"]) not in FAULT_RANKS:
            checks.fail(f"diagnosis of {job}: rank {entry['rank']!r} is not the rank at fault at "
                        f"{me.world_size} ranks - {hint}")
        elif line not in source or not line:
            checks.fail(f"diagnosis of {job}: {entry['line']!r} is not a line of {broken.__name__}: "
                        f"copy the faulty line as it stands")
        elif fingerprint(job, line) not in FAULT_LINES[job]:
            checks.fail(f"diagnosis of {job}: the line {entry['line']!r} is not where the rank at fault "
                        f"parts ways from the others - {hint}")
        elif len(str(entry["cause"]).split()) < 4:
            checks.fail(f"diagnosis of {job}: say in a sentence why it fails (the cause)")
        else:
            checks.expect(True, "")


# --- A broken job under the microscope (--broken jobN) --------------------------------------------


def broken_job() -> str | None:
    if "--broken" not in sys.argv:
        return None
    at = sys.argv.index("--broken")
    return sys.argv[at + 1] if at + 1 < len(sys.argv) else ""


def recorder_lines(count: int = 6) -> list[str]:
    """This rank's last collectives from the flight recorder, with the lab's lines that called each."""
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    except Exception as error:  # a private API: say so rather than fail
        return [f"flight recorder unavailable ({type(error).__name__})"]
    ours_only = [e for e in dump.get("entries", []) if e.get("pg_id") == 0]  # DETAIL adds a helper group's
    lines = []
    for entry in ours_only[-count:]:
        frames = [f for f in entry.get("frames", []) if f["filename"].endswith(LAB_FILE) and f["name"] != "<module>"]
        called = " <- ".join(f"line {f['line']} ({f['name']})" for f in frames[:2]) or "?"
        lines.append(f"#{entry['collective_seq_id']} {entry['profiling_name'].split(':')[-1]} of "
                     f"{entry['input_sizes']}, called at {called}")
    return lines


def write_dumps(stacks, recorder: Path, rank: int, main_thread: int) -> None:
    """This rank's Python stack (its main thread) appended to `stacks`, then its flight recorder."""
    frame = sys._current_frames().get(main_thread)
    if frame is not None:
        stacks.write(f"rank {rank}, pid {os.getpid()}: where the main thread is, {DUMP_AFTER:.0f} s after the "
                     f"job started (most recent call last):\n" + "".join(traceback.format_stack(frame)) + "\n")
        stacks.flush()
    lines = recorder_lines()
    recorder.write_text(f"rank {rank}: its last {len(lines)} collectives in the flight recorder, oldest first "
                        f"(#: the group's sequence number)\n" + "\n".join(lines) + "\n")


def short(error: BaseException) -> str:
    """One line for an error of a broken job: DETAIL's messages (hundreds of characters) shortened."""
    text = str(error)
    mismatch = re.search(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                         r"OpType=(\w+), TensorShape=(\[[^\]]*\])", text)
    if mismatch:
        rank, seq, op, shape = mismatch.groups()
        return (f"TORCH_DISTRIBUTED_DEBUG=DETAIL: collective #{seq} differs across ranks; this rank calls "
                f"{op.lower()} of {shape} at {where(error)}")
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if missing:
        return (f"DETAIL's monitored barrier: rank(s) {missing.group(1)} never came to the collective that "
                f"this rank called at {where(error)}")
    relayed = re.search(r"received errors while waiting for send/recv from rank (\d+)", text)
    if relayed:
        return (f"DETAIL's monitored barrier: this rank came to its collective at {where(error)}, and "
                f"lost rank {relayed.group(1)} while it waited (read rank {relayed.group(1)}'s message)")
    if "timed out" in text.lower() or "timeout" in type(error).__name__.lower():
        return f"timed out in a collective at {where(error)}, waiting for a rank that never joined it"
    if "closed by peer" in text.lower() or "reset by peer" in text.lower():
        return f"a peer closed the connection during the collective at {where(error)}"
    first = text.strip().splitlines()[0][:160] if text.strip() else ""
    return f"{type(error).__name__}: {first} at {where(error)}"


def run_broken(me: Rank, checks: Checks, job: str) -> None:
    jobs = {"job1": lab.job1_broken, "job2": lab.job2_broken, "job3": lab.job3_broken}
    if job not in jobs:
        checks.fail(f"--broken takes job1, job2 or job3, not {job!r}")
        return
    folder = ROOT / "runs" / "lab14" / job
    folder.mkdir(parents=True, exist_ok=True)
    shown = os.path.relpath(folder) if not os.path.relpath(folder).startswith("..") else str(folder)
    if me.rank == 0:  # the files of an earlier run on more ranks would mislead
        for stale in folder.glob("*_rank*.txt"):
            if int(stale.stem.rsplit("rank", 1)[1]) >= me.world_size:
                stale.unlink(missing_ok=True)
    stacks = open(folder / f"stacks_rank{me.rank}.txt", "w")
    recorder = folder / f"collectives_rank{me.rank}.txt"
    recorder.unlink(missing_ok=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # kill -USR1 <pid>: a fresh stack
    timer = threading.Timer(DUMP_AFTER, write_dumps, args=(stacks, recorder, me.rank, threading.get_ident()))
    timer.daemon = True
    timer.start()
    post(f"pid-{job}", me.rank, {"pid": os.getpid()})
    if me.rank == 0:
        tools = ("TORCH_DISTRIBUTED_DEBUG=DETAIL, " if job != "job1" else "") + "the flight recorder"
        pids = wait_for_the_others(f"pid-{job}", me.world_size, 30)
        print(f"== {job}_broken as it was handed over, on {me.world_size} ranks: {tools} on, a "
              f"{BROKEN_TIMEOUT[job].total_seconds():.0f} s timeout ==\n"
              f"pids: " + ", ".join(f"rank {r} {pids[r]['pid']}" for r in sorted(pids)) + "\n"
              f"After {DUMP_AFTER:.0f} s each rank writes its Python stack to {shown}/stacks_rank<R>.txt and its "
              f"last collectives to {shown}/collectives_rank<R>.txt; `kill -USR1 <pid>` adds a fresh stack"
              + (", and `py-spy dump --pid <pid>` shows one" if shutil.which("py-spy") else "")
              + ". Ctrl-C ends the job.", flush=True)
    start = time.monotonic()
    try:
        jobs[job](me)
        outcome = f"returned from {job}_broken"
    except Exception as error:
        outcome = short(error)
    post(f"broken-{job}", me.rank, {"kind": "outcome", "text": outcome})
    states = wait_for_the_others(f"broken-{job}", me.world_size, 3 * BROKEN_TIMEOUT[job].total_seconds() + 10)
    waited = time.monotonic() - start
    timer.cancel()
    if me.rank == 0:
        groups: dict[str, list[int]] = {}
        for rank in range(me.world_size):
            groups.setdefault(states[rank]["text"] if rank in states else "sent no news", []).append(rank)
        print(f"\n== Lab 14 (debugging): {job}_broken, as handed over, on {me.world_size} ranks ==")
        for text, ranks in groups.items():
            print(f"{ranks_label(ranks)}: {text}")
        if waited > DUMP_AFTER:
            print(f"Each rank's stacks and last collectives are in {shown}/ (stacks_rank<R>.txt, "
                  f"collectives_rank<R>.txt): read them side by side.")
        print(f"Find the rank that is not where the others are and the line where it parts ways; "
              f"then write {job}_fixed and your diagnosis, and run the lab without --broken.", flush=True)
    finish(0)  # the broken job did what it was run for: no verdict, and no torchrun report


def main(me: Rank, checks: Checks) -> None:
    job = broken_job()
    if job is not None:
        run_broken(me, checks, job)
        return
    for fixed, check in ((lab.job1_fixed, check_job1), (lab.job2_fixed, check_job2), (lab.job3_fixed, check_job3),
                         (job3_fixed_with_inf_labels, lambda *a: check_job3(*a, bad=float("inf")))):
        if fixed is job3_fixed_with_inf_labels and checks.failures:  # inf labels once the rest is right
            break
        ran, result = run_fixed(fixed, me, checks)
        if not ran or not everyone_returned(fixed, me, checks):  # the group is broken: fix this job first
            return
        check(me, checks, result)
    if checks.failures or not check_on_gpu(me, checks):
        return
    print0(f"the three fixed jobs match their single-process references on {me.world_size} ranks")
    check_diagnoses(me, checks)


def check_on_gpu(me: Rank, checks: Checks) -> bool:
    """The three fixed jobs run again as on a GPU machine (ringside.effects.on_rank_gpu): `me.device` is
    this rank's stand-in GPU and the backend nccl, so a tensor a job makes elsewhere, or hands a
    collective off that GPU, is named as a GPU run would show it. One verdict for every rank."""
    for job in (lab.job1_fixed, lab.job2_fixed, lab.job3_fixed):
        problem, note = on_rank_gpu(job.__name__, lambda device: job(dataclasses.replace(
            me, backend="nccl", device=device)), job, what="what it returned")
        if note:
            print0(note)
        if not checks.agree(problem):
            return False
    return True


def prepared_for(world_size: int) -> str | None:
    """The faults need several ranks; the diagnoses are prepared for 2, 3 and 4."""
    if world_size == 1:
        return ("each broken job fails because one rank parts ways with the others (a rank that stops, a shape "
                "that differs, an error the others never hear of): one rank has no one to part from - "
                "use --nproc-per-node 2, 3 or 4")
    if world_size > 4:
        return ("the rank at fault in each broken job depends on the world size, and the lab's diagnoses "
                "(diagnose(world_size)) are prepared for 2, 3 and 4 ranks: use --nproc-per-node 2, 3 or 4")
    return None


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    job = broken_job()
    # The tools must be on before the process group exists. DETAIL checks every collective against
    # the other ranks' first; it would hold a hung job1's collective back before the flight recorder
    # saw it, so job1 runs without it.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF" if job == "job1" else "DETAIL"
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"  # the flight recorder (on by default, 2,000): keep the last 64
    dist.set_debug_level_from_env()  # torch.distributed read the variable when it was imported
    run_lab(main, title="Lab 14 (debugging)", refuse=prepared_for, timeout=BROKEN_TIMEOUT.get(job, TIMEOUT))
