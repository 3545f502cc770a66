"""The check of lab 11 (capstone): it runs the code of labs/11_capstone.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.compare import all_gather_tensor, flat_params, max_diff
from ringside.syncbn import SyncBatchNorm

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------


def check_sharding(checks: Checks, result: lab.Result, train_size: int, args: argparse.Namespace, me: Rank) -> None:
    batch = args.batch_size // me.world_size
    share = -(-train_size // me.world_size)  # DistributedSampler's share per rank
    expected = share // batch  # in full batches
    steps = len(result.loader)
    if steps == -(-share // batch) and steps != expected:
        hint = ("the last batch of each epoch is a partial one - drop_last=True in the DataLoader, so that "
                "every step is a full batch on every rank")
    elif steps > expected:
        hint = ("every rank trains on the whole data set - give the DistributedSampler num_replicas=world_size "
                "and rank=rank")
    else:
        hint = "too little data per rank"
    checks.expect(steps == expected, f"an epoch has {steps} steps per rank, expected {expected}: {hint}")
    sampler = result.loader.sampler
    checks.expect(isinstance(sampler, DistributedSampler) and sampler.epoch == args.epochs - 1,
                  f"after {args.epochs} epochs the sampler's epoch is {getattr(sampler, 'epoch', None)}: "
                  f"every epoch saw the same order - call loader.sampler.set_epoch(epoch) each epoch")
    every = [None] * me.world_size
    dist.all_gather_object(every, list(sampler))
    covered = len(set().union(*map(set, every)))
    checks.expect(covered == train_size,
                  f"the ranks' shards together cover {covered} of {train_size} training images (they overlap): "
                  f"the sampler's seed must be the same on every rank (seed, not seed + rank), so that all ranks "
                  f"cut one shared permutation")


def check_replicas(checks: Checks, model: nn.Module) -> None:
    weights = flat_params(model)
    if not checks.expect(bool(torch.isfinite(weights).all()),
                         "the weights are NaN or inf after training: a step was taken with inf or NaN "
                         "gradients (scaler.step(optimizer) skips those) or the learning rate diverged"):
        return
    copies = all_gather_tensor(weights)
    worst = max(max_diff(copies[0], other) for other in copies)
    checks.expect(worst == 0.0, f"the ranks' weights differ after training (max diff {worst:.2e}): "
                                f"did you wrap the model in DDP, so that gradients are averaged?")
    modules = list(model.modules())
    batchnorms = [m for m in modules if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    checks.expect(all(isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm)) for m in batchnorms),
                  "some BatchNorm layers are not synchronized: each rank normalizes with its own "
                  "small batch - call convert_sync_batchnorm(net) before wrapping in DDP")


AMP_HINTS = {
    "no scale": "the loss was not scaled: backward on scaler.scale(loss), so that small float16 gradients "
                "survive (scaler.step divides them by the scale)",
    "optimizer.step": "optimizer.step() used the scaled gradients and stepped with inf ones: call "
                      "scaler.step(optimizer), which unscales and skips a step whose gradients hold an inf or NaN",
    "no update": "the scale did not change after the step with inf gradients: call scaler.update() after "
                 "scaler.step(optimizer)",
    "no zero_grad": "the gradients add up across steps: zero them once per step (optimizer.zero_grad)",
}


def amp_steps(step_fn, device: torch.device) -> tuple[list[tuple[torch.Tensor, float]], Exception | None]:
    """Four steps of a tiny model under float16 autocast with an enabled GradScaler (on the CPU too:
    its float16 overflows are real); the third batch holds an inf. Returns (weights, scale) after
    each step done, and the error that stopped the steps (None when all four ran)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    trajectory = []
    for step in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        if step == 2:
            x[0, 0] = float("inf")
        try:
            step_fn(model, x.to(device), y.to(device), optimizer, scaler)
        except NotImplementedError:
            raise
        except Exception as error:  # a step that raises is a finding: keep what ran before it
            return trajectory, error
        trajectory.append((flat_params(model), float(scaler.get_scale())))
    return trajectory, None


def reference_amp_step(variant: str | None):
    """The right train step, or one classic mistake in it (a key of AMP_HINTS)."""
    def step(model, images, labels, optimizer, scaler):
        with torch.autocast(images.device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        (loss if variant == "no scale" else scaler.scale(loss)).backward()
        optimizer.step() if variant == "optimizer.step" else scaler.step(optimizer)
        if variant != "no update":
            scaler.update()
        if variant != "no zero_grad":
            optimizer.zero_grad(set_to_none=True)
    return step


def check_amp_step(checks: Checks, me: Rank) -> None:
    """train_step with float16 autocast and an enabled GradScaler, against the right step and the
    classic wrong ones (the default CPU run trains without them, so this is where they show)."""
    dtypes = []

    def learners_step(model, images, labels, optimizer, scaler):
        hook = model[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
        try:
            lab.train_step(model, images, labels, optimizer, scaler, torch.float16)
        finally:
            hook.remove()

    mine, error = amp_steps(learners_step, me.device)
    if dtypes and dtypes[0] != torch.float16:
        checks.fail(f"with dtype=float16 the forward ran in {dtypes[0]}: run the forward and the loss inside "
                    f"torch.autocast(images.device.type, dtype=dtype)")
        return
    if error is not None:
        said = str(error).strip().splitlines()[0] if str(error).strip() else ""
        known = {"_scale is None": "backward on scaler.scale(loss), not on the loss itself",
                 "No inf checks": "scaler.step(optimizer) unscales and checks the gradients: call it instead "
                                  "of optimizer.step()",
                 "since the last update()": "call scaler.update() once per step, after scaler.step(optimizer)"}
        hint = next((f" - {h}" for words, h in known.items() if words in said), "")
        checks.fail(f"float16 + GradScaler: train_step raised at step {len(mine)}: {type(error).__name__}: "
                    f"{said}{hint}")
        return
    ref, _ = amp_steps(reference_amp_step(None), me.device)
    variants = {name: amp_steps(reference_amp_step(name), me.device)[0] for name in AMP_HINTS}

    def same(a, b) -> bool:  # the same operations in the same order: equal up to float32 rounding
        return max_diff(a[0], b[0]) <= 1e-6 and a[1] == b[1]

    for t, (got, want) in enumerate(zip(mine, ref)):
        if same(got, want):
            continue
        fits = [name for name, run in variants.items()
                if len(run) > t and all(same(a, b) for a, b in zip(mine[:t + 1], run))]
        hint = "; or ".join(AMP_HINTS[name] for name in fits) or (
            "autocast around forward and loss, scaler.scale(loss).backward(), scaler.step(optimizer), "
            "scaler.update(), then zero the gradients")
        if not bool(torch.isfinite(got[0]).all()):
            checks.fail(f"float16 + GradScaler: the weights are NaN or inf after step {t} (its batch held an "
                        f"inf): {hint}")
        else:
            checks.fail(f"float16 + GradScaler: after step {t} the weights differ from the right step's by "
                        f"{max_diff(got[0], want[0]):.2e} and the scale is {got[1]:g} (expected {want[1]:g}): {hint}")
        return
    checks.expect(True, "")


def check_evaluation(checks: Checks, result: lab.Result, test_set: TensorDataset) -> None:
    """The distributed result must equal one process evaluating the whole test set."""
    net = result.model.module.eval()
    with torch.no_grad():
        images, labels = (t.to(next(net.parameters()).device) for t in test_set.tensors)
        logits = net(images).float()
        ref_correct = int((logits.argmax(1) == labels).sum())
        ref_loss = F.cross_entropy(logits, labels).item()
    got = result.test
    if got["count"] > len(test_set):
        hint = "some images were counted twice - DistributedSampler pads; take every world_size-th index"
    elif got["count"] < len(test_set):
        hint = "only this rank's part was counted - did you all_reduce the totals?"
    else:
        hint = "add up loss (reduction='sum'), correct and count before dividing"
    checks.expect(got["count"] == len(test_set) and got["correct"] == ref_correct,
                  f"evaluation counted {got['correct']} correct of {got['count']}, one process counts "
                  f"{ref_correct} of {len(test_set)}: {hint}")
    # float64 sums of the same per-image losses in another order: 1e-5 is far above rounding
    checks.expect(abs(got["loss"] - ref_loss) <= 1e-5 * max(1.0, ref_loss),
                  f"evaluation loss {got['loss']:.6f}, one process gets {ref_loss:.6f}: {hint}")


def check_accuracy(checks: Checks, result: lab.Result, args: argparse.Namespace) -> None:
    defaults = lab.parse_args([])
    measured = all(getattr(args, k) == getattr(defaults, k) for k in ("data", "epochs", "batch_size", "lr", "seed"))
    low, high = lab.ACCURACY_BAND if measured else (0.5, 1.0)  # other settings: at least far better than chance
    acc = result.test["accuracy"]
    print0(f"test accuracy {acc:.3f} (band {low:.2f}-{high:.2f}) after {result.progress.global_step} steps")
    checks.expect(low <= acc <= high,
                  f"test accuracy {acc:.3f} is outside the band {low}-{high} (measured at 1, 2 and 4 ranks): "
                  f"check the train step (autocast, scaler.step, zero_grad) and the data split")


def check_atomic_save(checks: Checks, directory: Path, me: Rank) -> None:
    """A save that fails half-way must leave the previous checkpoint readable."""
    path = directory / f"atomic-check-rank{me.rank}.pt"
    good = {"value": torch.arange(5)}
    lab.save_checkpoint(path, good)
    try:
        lab.save_checkpoint(path, {"value": torch.arange(5), "cannot be saved": lambda: 0})
    except Exception:
        pass  # the second save must fail: a lambda cannot be pickled
    try:
        survived = torch.equal(torch.load(path, weights_only=True)["value"], good["value"])
    except Exception:
        survived = False
    checks.expect(survived, "a save that failed half-way destroyed the previous checkpoint: torch.save "
                            "into a temporary file in the same folder, then os.replace it onto the path")
    leftovers = sorted(p.name for p in directory.iterdir() if p.name.startswith(f".{path.name}"))
    checks.expect(not leftovers, f"a failed save left {leftovers} behind: delete the temporary file when saving fails")
    path.unlink(missing_ok=True)

    unsafe = directory / f"unsafe-check-rank{me.rank}.pt"
    torch.save({"config": argparse.Namespace(a=1)}, unsafe)  # an arbitrary pickled object
    try:
        lab.read_checkpoint(unsafe, me.device)
        refused = False
    except Exception:
        refused = True
    unsafe.unlink(missing_ok=True)
    checks.expect(refused, "read_checkpoint loaded an arbitrary pickled object: pass weights_only=True to "
                           "torch.load, so that a checkpoint cannot run code")


def check_resume(checks: Checks, args: argparse.Namespace, me: Rank, reference: lab.Result) -> None:
    """Crash a second run mid-epoch, resume it, and compare with the uninterrupted run bit for bit."""
    steps_per_epoch = len(reference.loader)
    crash = steps_per_epoch * (args.epochs // 2) + steps_per_epoch // 2 + 3  # mid-epoch, past a checkpoint
    crash += 1 if crash % args.checkpoint_every == 0 else 0
    last_checkpoint = crash - crash % args.checkpoint_every
    run = argparse.Namespace(**{**vars(args), "out": str(Path(args.out) / "resume-check"), "fresh": True,
                                "progress": False, "kill_at_step": None})
    try:
        lab.train(run, me, crash_at_step=crash)
    except lab.SimulatedCrash:
        pass
    print0(f"resume check: crashed before step {crash}, resuming from the checkpoint of step {last_checkpoint}")
    resumed = lab.train(argparse.Namespace(**{**vars(run), "fresh": False}), me)
    checks.expect(resumed.resumed_from == last_checkpoint,
                  f"the resumed run started at step {resumed.resumed_from}, the last checkpoint was at step "
                  f"{last_checkpoint}: restore Progress from the checkpoint")
    expected_steps = reference.progress.global_step - last_checkpoint
    checks.expect(resumed.steps_run == expected_steps,
                  f"after resuming it trained {resumed.steps_run} steps, {expected_steps} were left: skip the "
                  f"progress.step_in_epoch batches already done (itertools.islice), do not restart the epoch")
    diff = max_diff(flat_params(resumed.model), flat_params(reference.model))
    checks.expect(diff == 0.0,
                  f"the resumed run's final weights differ from the uninterrupted run's (max diff {diff:.2e}): "
                  f"restore the optimizer (momentum), scheduler and scaler, and seed the augmentation from "
                  f"(seed, rank, epoch, step) so that every redone step draws the same")
    buffers = max_diff(torch.cat([b.flatten().float() for b in resumed.model.module.buffers()]),
                       torch.cat([b.flatten().float() for b in reference.model.module.buffers()]))
    checks.expect(buffers == 0.0, f"the BatchNorm running statistics differ after resuming (max diff {buffers:.2e}): "
                                  f"restore the model's whole state_dict (buffers too)")


def main(checks: Checks) -> None:
    args = lab.parse_args()
    me = lab.join_group()
    print0(f"training on {me.world_size} rank(s), backend {me.backend}, autocast {lab.amp_dtype(args, me)}")
    result = lab.train(args, me)
    train_set, test_set = lab.load_data(args)
    check_sharding(checks, result, len(train_set), args, me)
    check_replicas(checks, result.model)
    check_amp_step(checks, me)
    check_evaluation(checks, result, test_set)
    check_accuracy(checks, result, args)
    check_atomic_save(checks, Path(args.out), me)
    if args.resume_check and not checks.failures:  # a fixed first failure may fix the rest: fail fast
        check_resume(checks, args, me, result)
    print0(f"final weights, history and curves in {args.out}/")


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 11 (capstone)", init=False)
