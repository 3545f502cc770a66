"""The check of lab 14 (debugging): it runs the code of labs/14_debugging.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import faulthandler
import hashlib
import inspect
import os
import pickle
import signal
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab
from ringside.lab import explain

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks: each fixed job against a single-process reference --------------------------------


def reference_job1() -> tuple[torch.Tensor, list[float]]:
    """Full-batch gradient descent on all 96 samples in one process: with equal shards, the mean
    of the shards' mean gradients is the full mean gradient, and so for the loss."""
    x, y = lab.training_data(torch.device("cpu"))
    w, logged = lab.new_weights(torch.device("cpu")), []
    for step in range(lab.STEPS):
        loss = lab.batch_loss(w, x, y)
        if step % lab.LOG_EVERY == 0:
            logged.append(loss.item())
        w.grad = None
        loss.backward()
        with torch.no_grad():
            w -= lab.LR * w.grad
    return w.detach(), logged


def reference_job2() -> float:
    """The mean squared error over all 1001 samples, in one process, in float64."""
    x, y, w = lab.validation_data(torch.device("cpu"))
    return ((x.double() @ w.double() - y.double()) ** 2).mean().item()


def reference_job3(world_size: int) -> torch.Tensor:
    """Every rank's step simulated in one process: the shards' gradients averaged, and a step
    skipped by all when any shard's batch loss is not finite."""
    x, y = lab.training_data(torch.device("cpu"), corrupt=True)
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


def run_fixed(job, me: Rank, checks: Checks):
    """Run a fixed job; a crash or a timeout becomes a verdict that names the job (then stop:
    a group that a collective left broken cannot run the next job)."""
    try:
        return True, job(me)
    except NotImplementedError:
        raise
    except Exception as error:
        why = explain(error)
        if job.__name__ == "job2_fixed" and ("reset by peer" in why or "closed" in why):
            # gloo, all_gather of unequal sizes: the rank that receives more than it expects aborts
            # (SIGABRT), so its peers see a dead connection rather than the mismatch itself
            why += (" - a peer died inside a collective: an all_gather of chunks of unequal sizes "
                    "aborts the rank that receives more than it expects")
        checks.fail(f"{job.__name__} failed on rank {me.rank}: {why}")
        return False, None


def check_job1(me: Rank, checks: Checks, result) -> None:
    w, logged = result
    ref_w, ref_logged = reference_job1()
    if torch.isnan(w).any():
        checks.fail("job1_fixed: the weights hold NaN")
    checks.expect(close(w, ref_w), "job1_fixed: the weights differ from full-batch gradient descent "
                                   "in one process - change only the logging, not the training step")
    shared = [logged]  # rank 0's log, which is the one that counts, checked on every rank
    dist.broadcast_object_list(shared, src=0)
    logged = shared[0]
    if not isinstance(logged, list) or len(logged) != len(ref_logged):
        checks.fail(f"job1_fixed: rank 0 logged {logged!r}, expected {len(ref_logged)} losses "
                    f"(steps 0, {lab.LOG_EVERY}, {2 * lab.LOG_EVERY})")
        return
    try:
        got = torch.tensor([float(v) for v in logged], dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        checks.fail(f"job1_fixed: rank 0 logged {logged!r}, expected numbers (use .item())")
        return
    want = torch.tensor(ref_logged, dtype=torch.float64)
    ratio = (got / want).mean().item()
    if close(got, want):
        checks.expect(True, "")
    elif abs(ratio - me.world_size) < 1e-3:
        checks.fail(f"job1_fixed: the logged losses are {me.world_size}x too large - the "
                    f"all_reduce adds the ranks' losses: divide by world_size")
    else:
        checks.fail(f"job1_fixed: rank 0 logged {[round(v, 4) for v in logged]}, expected the "
                    f"mean over ranks {[round(v, 4) for v in ref_logged]} - did every rank's "
                    f"loss enter the all_reduce?")


def check_job2(me: Rank, checks: Checks, mse) -> None:
    want = reference_job2()
    if not isinstance(mse, float):
        checks.fail(f"job2_fixed returned {type(mse).__name__}, expected a float (use .item())")
        return
    x, y, w = lab.validation_data(torch.device("cpu"))
    chunks = [((xc @ w - yc) ** 2).double() for xc, yc in zip(x.chunk(me.world_size), y.chunk(me.world_size))]
    mean_of_means = sum(c.mean().item() for c in chunks) / me.world_size
    mine = chunks[me.rank].mean().item()
    tolerance = 1e-6 * want  # float32 squared errors added in float64: relative error about 1e-7
    if mse != mse:
        hint = ("NaN - uninitialized values entered the mean: was it an all_gather of chunks of "
                "unequal sizes? (all_gather needs one shape on every rank)")
    elif abs(mse - mean_of_means) <= tolerance:
        hint = "that is the mean of the ranks' means: the chunks have unequal sizes, so add sums and counts"
    elif abs(mse - mine) <= tolerance:
        hint = "that is this rank's own chunk only: combine the ranks' results with a collective"
    else:
        hint = ("did padding, a wrong count or an all_gather of chunks of unequal sizes enter the "
                "mean? divide the total sum by 1001")
    checks.expect(abs(mse - want) <= tolerance,
                  f"job2_fixed: the mean squared error is {mse:.6f} on rank {me.rank}, expected "
                  f"{want:.6f} - {hint}")


def check_job3(me: Rank, checks: Checks, w) -> None:
    want = reference_job3(me.world_size)
    if torch.isnan(w).any():
        checks.fail("job3_fixed: the weights hold NaN - the step with the corrupt sample was not "
                    "skipped on every rank")
    elif not close(w, want):
        checks.fail("job3_fixed: the weights differ from the reference that skips, on every rank, "
                    "the one step in which some rank's loss is not finite - did a rank skip alone, "
                    "or did every rank skip more than that step?")
    else:
        checks.expect(True, "")


def fingerprint(*parts) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


# The answers, kept as fingerprints (job, world size, rank) and (job, line) so that reading the
# check does not give them away. Each job accepts either of two lines.
FAULT_RANKS = {"ac3bf3a074ee5aa2", "ddbb76a1bcaeaac3", "582af1946f95a8a0", "3b09f505ed279966",
               "145ce290f9e60f15", "b1534717631c25a8", "b348fa9cbdb8aaf0", "a3a8bf0e25ae1bc1",
               "b825ac24c31f3306"}
FAULT_LINES = {"job1": {"cccaef81f6132e62", "6571be5438b66085"},
               "job2": {"a296c32b6a7938a6", "f5d6d5d12312807f"},
               "job3": {"ede296f9ac1e41b0", "5311414388c0de77"}}
HOW_TO_FIND = {
    "job1": ("job1_broken", "which rank sits in a collective that the others never call? Dump every "
                            "rank's stack (kill -USR1) and read them side by side"),
    "job2": ("job2_broken", "whose tensor has a shape unlike the others'? TORCH_DISTRIBUTED_DEBUG=DETAIL "
                            "prints every rank's shapes"),
    "job3": ("job3_broken", "which rank raised first? The others only timed out waiting for it: look "
                            "for the first traceback, not the last"),
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
            checks.fail(f"diagnosis of {job}: the line {entry['line']!r} runs the same on every rank "
                        f"and is not where the ranks part ways - {hint}")
        elif len(str(entry["cause"]).split()) < 4:
            checks.fail(f"diagnosis of {job}: say in a sentence why it fails (the cause)")
        else:
            checks.expect(True, "")


# --- A broken job under the microscope (--broken jobN) --------------------------------------------


def last_collectives(count: int = 2) -> list[str]:
    """This rank's last collectives from the flight recorder, with the line that called each."""
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    except Exception as error:  # a private API: say so rather than fail
        return [f"flight recorder unavailable ({type(error).__name__})"]
    ours_only = [e for e in dump.get("entries", []) if e.get("pg_id") == 0]  # DETAIL adds a helper group's
    lines = []
    for entry in ours_only[-count:]:
        ours = [f for f in entry.get("frames", []) if f["filename"].endswith("14_debugging.py")]
        where = f"line {ours[0]['line']} ({ours[0]['name']})" if ours else "?"
        lines.append(f"#{entry['collective_seq_id']} {entry['profiling_name']} sizes "
                     f"{entry['input_sizes']} called at {where}")
    return lines


def run_broken(me: Rank, checks: Checks, job: str) -> None:
    jobs = {"job1": lab.job1_broken, "job2": lab.job2_broken, "job3": lab.job3_broken}
    if job not in jobs:
        checks.fail(f"--broken takes job1, job2 or job3, not {job!r}")
        return
    faulthandler.register(signal.SIGUSR1, all_threads=False)  # kill -USR1 <pid>: this rank's stack
    print(f"rank {me.rank}: pid {os.getpid()}, running {job}_broken", flush=True)
    try:
        jobs[job](me)
        checks.fail(f"{job}_broken finished on rank {me.rank} (it fails on other ranks)")
    except Exception as error:
        recorded = "; ".join(last_collectives())
        checks.fail(f"{job}_broken on rank {me.rank}: {explain(error)}; last collectives: {recorded}")


def main(me: Rank, checks: Checks) -> None:
    if lab.BROKEN:
        run_broken(me, checks, lab.BROKEN)
        return
    for job, check in ((lab.job1_fixed, check_job1), (lab.job2_fixed, check_job2), (lab.job3_fixed, check_job3)):
        ran, result = run_fixed(job, me, checks)
        if ran:
            check(me, checks, result)
        if checks.failures:  # a failed collective can leave the group broken: fix this job first
            return
    print0(f"the three fixed jobs match their single-process references on {me.world_size} ranks")
    check_diagnoses(me, checks)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 14 (debugging)", world_sizes=(2, 3, 4), timeout=timedelta(seconds=10))
