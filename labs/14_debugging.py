"""Lab 14 - debugging: three broken jobs, each diagnosed and fixed.

Below are three short jobs as a colleague handed them to you. Each works on one process and
fails on several: one hangs, one dies with a message about sizes, one loses a rank mid-epoch
while the others wait. For each job:
  1. run the broken job and find the faulty rank and line with the tools of chapter 14:
         OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/14_debugging.py --broken job1
     (--broken runs that job as it was handed to you, with TORCH_DISTRIBUTED_DEBUG=DETAIL and the
     flight recorder on, a 10 s timeout, and each rank's pid printed: `kill -USR1 <pid>` from
     another terminal dumps that rank's Python stack, `py-spy dump --pid <pid>` too if you have it);
  2. write the fixed job (jobN_fixed) and record your diagnosis in `diagnose`.
The check runs the fixed jobs and compares their results with a single-process reference, and
checks that each diagnosis names the rank at fault and the line where it goes wrong.

Run it with 4 processes (2, 3 and 4 are accepted):
    make lab CH=14 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/14_debugging.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/14_debugging.py; edit that one.)

import faulthandler
import hashlib
import inspect
import os
import pickle
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringside import Checks, Rank, print0, run_lab
from ringside.data import regression
from ringside.lab import explain

BROKEN = sys.argv[sys.argv.index("--broken") + 1] if "--broken" in sys.argv[:-1] else None
if BROKEN:  # the debugging tools must be switched on before the process group exists
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # collectives compared across ranks
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")  # the flight recorder: last 64 collectives
    dist.set_debug_level_from_env()  # torch.distributed read the variable when it was imported

FEATURES = 8
N_TRAIN = 96  # divisible by 2, 3 and 4: every rank gets an equal shard of the training set
STEPS = 9  # job 1: full-batch steps
LOG_EVERY = 4  # job 1: log the loss at steps 0, 4, 8
LR = 0.1
N_VAL = 1001  # job 2: validation samples
BATCH = 4  # job 3: samples per rank and step
BAD_SAMPLE = 37  # job 3: the index of a corrupt record


# --- What the three jobs share (correct as it is) -------------------------------------------------


def training_data(device: torch.device, corrupt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same 96 samples on every rank; corrupt=True spoils one record with a NaN (job 3)."""
    x, y = regression(N_TRAIN, FEATURES, seed=0).tensors
    if corrupt:
        x[BAD_SAMPLE, 0] = float("nan")
    return x.to(device), y.to(device)


def validation_data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1001 validation samples and the weights to evaluate, the same on every rank (job 2)."""
    x, y = regression(N_VAL, FEATURES, seed=1).tensors
    w = torch.linspace(-1, 1, FEATURES).reshape(FEATURES, 1)
    return x.to(device), y.to(device), w.to(device)


def my_training_shard(me: Rank, corrupt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the training data: rank r takes the samples r, r + W, r + 2W, ..."""
    x, y = training_data(me.device, corrupt)
    return x[me.rank::me.world_size], y[me.rank::me.world_size]


def new_weights(device: torch.device) -> torch.Tensor:
    return torch.zeros(FEATURES, 1, device=device, requires_grad=True)


def batch_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(x @ w, y)


def average_gradients_and_step(w: torch.Tensor, loss: torch.Tensor, me: Rank) -> None:
    """Backward, the gradient averaged over all ranks (one all_reduce), one SGD step."""
    w.grad = None
    loss.backward()
    dist.all_reduce(w.grad)
    with torch.no_grad():
        w -= LR * w.grad / me.world_size


# --- The three jobs as they were handed to you (leave these as they are) --------------------------


def job1_broken(me: Rank) -> tuple[torch.Tensor, list[float]]:
    """Train on full batches and log the mean loss over all ranks every LOG_EVERY steps.
    Returns the weights and the logged losses (rank 0 logs)."""
    x, y = my_training_shard(me)
    w, logged = new_weights(me.device), []
    for step in range(STEPS):
        loss = batch_loss(w, x, y)
        average_gradients_and_step(w, loss, me)
        if me.is_main and step % LOG_EVERY == 0:
            dist.all_reduce(loss)
            logged.append(loss.item() / me.world_size)
    return w.detach(), logged


def job2_broken(me: Rank) -> float:
    """The mean squared error of fixed weights over all 1001 validation samples, each rank
    evaluating one chunk."""
    x, y, w = validation_data(me.device)
    x, y = x.chunk(me.world_size)[me.rank], y.chunk(me.world_size)[me.rank]
    errors = ((x @ w - y) ** 2).flatten()
    gathered = [torch.empty_like(errors) for _ in range(me.world_size)]
    dist.all_gather(gathered, errors)
    return torch.cat(gathered).mean().item()


def job3_broken(me: Rank) -> torch.Tensor:
    """One epoch of SGD on mini-batches of BATCH samples per rank, stopping before a NaN can
    spread into the weights. Returns the weights."""
    x, y = my_training_shard(me, corrupt=True)
    w = new_weights(me.device)
    for start in range(0, len(x), BATCH):
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss.item()} at sample {start} of my shard")
        average_gradients_and_step(w, loss, me)
    return w.detach()


# --- Your part: the three jobs fixed, and your diagnosis ------------------------------------------


def job1_fixed(me: Rank) -> tuple[torch.Tensor, list[float]]:
    """Job 1, fixed: the same training and the same log (rank 0's `logged` holds the mean loss
    over all ranks at steps 0, 4, 8), and no rank ever waits for ever."""
    x, y = my_training_shard(me)
    w, logged = new_weights(me.device), []
    for step in range(STEPS):
        loss = batch_loss(w, x, y)
        average_gradients_and_step(w, loss, me)
        # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
        # TODO: every LOG_EVERY steps, rank 0 appends the mean of the ranks' losses to `logged`; every rank must take part in whatever collective that needs
        raise NotImplementedError("the TODO above")
    return w.detach(), logged


def job2_fixed(me: Rank) -> float:
    """Job 2, fixed: the mean squared error over all 1001 validation samples, exact, on every
    rank, each rank still evaluating its own chunk."""
    x, y, w = validation_data(me.device)
    x, y = x.chunk(me.world_size)[me.rank], y.chunk(me.world_size)[me.rank]
    errors = ((x @ w - y) ** 2).flatten()
    # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
    # TODO: combine the ranks' squared errors into the mean over all 1001 samples (sum and count, in float64, added up over the ranks) and return it as a float
    raise NotImplementedError("the TODO above")


def job3_fixed(me: Rank) -> torch.Tensor:
    """Job 3, fixed: the same epoch, but a step in which any rank's loss is not finite is skipped
    by every rank together (none raises, none updates its weights in that step)."""
    x, y = my_training_shard(me, corrupt=True)
    w = new_weights(me.device)
    for start in range(0, len(x), BATCH):
        loss = batch_loss(w, x[start:start + BATCH], y[start:start + BATCH])
        # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
        # TODO: let every rank learn whether any rank's loss is not finite, and if so skip the step on every rank; else average the gradients and step as before
        raise NotImplementedError("the TODO above")
    return w.detach()


def diagnose(world_size: int) -> dict:
    """Your diagnosis of each broken job at this world size: the rank at fault, the line of its
    jobN_broken where things go wrong (copied as it stands), and the cause in a sentence.

    The rank at fault: job 1, the rank that calls a collective the others never call; job 2, the
    rank whose tensor has a shape unlike the others'; job 3, the rank that raised first (the others
    only waited for it). Write a rank that depends on the world size as an expression of it."""
    # (stuck? `make hint CH=14` prints hint 1 of 2; run it again for the next)
    # TODO: return {"job1": {"rank": ..., "line": "...", "cause": "..."}, "job2": {...}, "job3": {...}}
    raise NotImplementedError("the TODO above")


# --- The checks: each fixed job against a single-process reference --------------------------------


def reference_job1() -> tuple[torch.Tensor, list[float]]:
    """Full-batch gradient descent on all 96 samples in one process: with equal shards, the mean
    of the shards' mean gradients is the full mean gradient, and so for the loss."""
    x, y = training_data(torch.device("cpu"))
    w, logged = new_weights(torch.device("cpu")), []
    for step in range(STEPS):
        loss = batch_loss(w, x, y)
        if step % LOG_EVERY == 0:
            logged.append(loss.item())
        w.grad = None
        loss.backward()
        with torch.no_grad():
            w -= LR * w.grad
    return w.detach(), logged


def reference_job2() -> float:
    """The mean squared error over all 1001 samples, in one process, in float64."""
    x, y, w = validation_data(torch.device("cpu"))
    return ((x.double() @ w.double() - y.double()) ** 2).mean().item()


def reference_job3(world_size: int) -> torch.Tensor:
    """Every rank's step simulated in one process: the shards' gradients averaged, and a step
    skipped by all when any shard's batch loss is not finite."""
    x, y = training_data(torch.device("cpu"), corrupt=True)
    shards = [(x[r::world_size], y[r::world_size]) for r in range(world_size)]
    w = new_weights(torch.device("cpu"))
    for start in range(0, N_TRAIN // world_size, BATCH):
        losses = [batch_loss(w, xs[start:start + BATCH], ys[start:start + BATCH]) for xs, ys in shards]
        if not all(torch.isfinite(loss) for loss in losses):
            continue
        grads = [torch.autograd.grad(loss, w)[0] for loss in losses]
        with torch.no_grad():
            w -= LR * torch.stack(grads).mean(dim=0)
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
                    f"(steps 0, {LOG_EVERY}, {2 * LOG_EVERY})")
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
    x, y, w = validation_data(torch.device("cpu"))
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
    "job1": (job1_broken, "which rank sits in a collective that the others never call? Dump every "
                          "rank's stack (kill -USR1) and read them side by side"),
    "job2": (job2_broken, "whose tensor has a shape unlike the others'? TORCH_DISTRIBUTED_DEBUG=DETAIL "
                          "prints every rank's shapes"),
    "job3": (job3_broken, "which rank raised first? The others only timed out waiting for it: look "
                          "for the first traceback, not the last"),
}


def normalized(line) -> str:
    return " ".join(str(line).split())


def check_diagnoses(me: Rank, checks: Checks) -> None:
    found = diagnose(me.world_size)
    if not isinstance(found, dict):
        checks.fail(f"diagnose returned {type(found).__name__}, expected a dict with keys job1, job2, job3")
        return
    for job, (broken, hint) in HOW_TO_FIND.items():
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
    jobs = {"job1": job1_broken, "job2": job2_broken, "job3": job3_broken}
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
    if BROKEN:
        run_broken(me, checks, BROKEN)
        return
    for job, check in ((job1_fixed, check_job1), (job2_fixed, check_job2), (job3_fixed, check_job3)):
        ran, result = run_fixed(job, me, checks)
        if ran:
            check(me, checks, result)
        if checks.failures:  # a failed collective can leave the group broken: fix this job first
            return
    print0(f"the three fixed jobs match their single-process references on {me.world_size} ranks")
    check_diagnoses(me, checks)


if __name__ == "__main__":
    run_lab(main, title="Lab 14 (debugging)", world_sizes=(2, 3, 4), timeout=timedelta(seconds=10))
