"""The check of lab 11 (capstone): it runs the code of labs/11_capstone.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import pickle
import re
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.capstone import ACCURACY_BAND, Progress, Result, amp_dtype, join_group, load_data, parse_args
from ringside.compare import all_gather_tensor, flat_params, max_diff

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------


def check_sharding(checks: Checks, result: Result, train_size: int, args: argparse.Namespace, me: Rank,
                   batches: "BatchLog") -> None:
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
    # Judged by what the sampler yielded, epoch by epoch (the batches train took, before augmentation),
    # whatever its class: lab 06's own ShardSampler is a drop-in for DistributedSampler.
    by_epoch: dict[int, list[str]] = {}
    for epoch, _, _, fingerprint in batches.records:
        by_epoch.setdefault(epoch, []).append(fingerprint)
    epochs = sorted(by_epoch)
    again = next(((e, f) for i, e in enumerate(epochs) for f in epochs[:i] if by_epoch[e] == by_epoch[f]), None)
    checks.expect(again is None,
                  f"epoch {again and again[0]} trained the very batches of epoch {again and again[1]}, in the same "
                  f"order: the sampler was not told the new epoch - call loader.sampler.set_epoch(epoch) each "
                  f"epoch, before its batches")
    every = [None] * me.world_size
    dist.all_gather_object(every, list(sampler))
    covered = len(set().union(*map(set, every)))
    # One shared permutation cut in world_size shares: padded (an image repeated) or cut short by
    # drop_last=True (an image left out), by fewer than world_size images either way.
    repeated, missing = sum(map(len, every)) - covered, train_size - covered
    if repeated >= me.world_size:
        checks.fail(f"the ranks' shards together cover {covered} of {train_size} training images, {repeated} of "
                    f"them on two ranks or more (they overlap): the sampler's seed must be the same on every rank "
                    f"(seed, not seed + rank), so that all ranks cut one shared permutation")
    elif missing >= me.world_size:
        checks.fail(f"the ranks' shards together cover {covered} of {train_size} training images: {missing} are on "
                    f"no rank - each rank takes its share of one permutation of the whole training set")
    else:
        checks.expect(True, "")


def check_augment(checks: Checks, train_set: TensorDataset, me: Rank) -> None:
    """augment's contract, tested directly: every image its own draw, the result set by the seed alone,
    this rank's random streams (CPU, and its GPU) where they were."""
    copies = train_set.tensors[0][:1].repeat(8, 1, 1, 1)  # one image, 8 times
    gpu = [me.device] if me.device.type == "cuda" else []

    def streams() -> list[torch.Tensor]:
        return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in gpu]

    with torch.random.fork_rng(devices=gpu):  # the check's own reseeding below stays in here
        before = streams()
        first = lab.augment(copies.clone(), 1234, me.device)
        after = streams()
        torch.manual_seed(4321)  # another global state: the same seed must still give the same batch
        again = lab.augment(copies.clone(), 1234, me.device)
        other = lab.augment(copies.clone(), 1235, me.device)
    if not (isinstance(first, torch.Tensor) and first.shape == copies.shape):
        checks.fail(f"augment returned {getattr(first, 'shape', type(first).__name__)} for a batch of shape "
                    f"{tuple(copies.shape)}: return the augmented images stacked in a batch of the same shape")
        return
    checks.expect(torch.equal(first, again),
                  "augment gave another batch for the same seed once the global random state had changed: its "
                  "draws do not come from `seed` alone - torch.manual_seed(seed) before drawing, inside "
                  "torch.random.fork_rng")
    checks.expect(torch.equal(after[0], before[0]),
                  "augment moved this rank's global random stream (the CPU generator is not where it was, so "
                  "everything drawn after it changes): seed and draw inside `with torch.random.fork_rng(...)`, "
                  "which puts the generators back")
    checks.expect(all(torch.equal(a, b) for a, b in zip(after[1:], before[1:])),
                  "augment moved this rank's GPU random stream (torch.manual_seed seeds every GPU): give "
                  "torch.random.fork_rng this rank's GPU, devices=[device]")
    if torch.equal(first, copies):
        checks.fail("augment returned the images unchanged: apply AUGMENT to them")
        return
    checks.expect(any(not torch.equal(first[0], image) for image in first[1:]),
                  "augment gave 8 copies of one image the very same rotation, shift and zoom: the whole batch "
                  "shared one draw (a transform called on a batch draws once) - augment one image at a time "
                  "and stack the results")
    checks.expect(not torch.equal(first, other),
                  "augment gave the same batch for seeds 1234 and 1235: draw from `seed` (torch.manual_seed(seed)), "
                  "not from a fixed seed")


def check_replicas(checks: Checks, model: nn.Module, train_set: TensorDataset) -> None:
    weights = flat_params(model)
    if not checks.expect(bool(torch.isfinite(weights).all()),
                         "the weights are NaN or inf after training: a step was taken with inf or NaN "
                         "gradients (scaler.step(optimizer) skips those) or the learning rate diverged"):
        return
    copies = all_gather_tensor(weights)
    worst = max(max_diff(copies[0], other) for other in copies)
    checks.expect(worst == 0.0, f"the ranks' weights differ after training (max diff {worst:.2e}): "
                                f"did you wrap the model in DDP, so that gradients are averaged?")
    # Judged by the effect, whatever the layers' class (lab 07's own SyncBatchNorm is right too): one
    # training-mode forward of a copy, each rank on other images; synchronized statistics leave every
    # rank's running statistics equal, a rank's own batch statistics do not.
    net = copy.deepcopy(getattr(model, "module", model))  # a copy: the run's own network stays as it was
    stats = [b for name, b in net.named_buffers() if name.rsplit(".", 1)[-1] in ("running_mean", "running_var")]
    if not stats:
        return
    rank = dist.get_rank()  # 16 training images, others on each rank
    images = train_set.tensors[0][16 * rank:16 * (rank + 1)].to(next(net.parameters()).device)
    net.train()
    with torch.no_grad():
        net(images)
    mine = torch.cat([b.detach().flatten().float() for b in stats])
    worst = max(max_diff(mine, other) for other in all_gather_tensor(mine))
    checks.expect(worst <= 1e-5,
                  f"after one training-mode forward on other images on each rank, the BatchNorm running statistics "
                  f"differ between ranks (max diff {worst:.2e}): some BatchNorm layers are not synchronized, so "
                  f"each rank normalizes with its own small batch - call convert_sync_batchnorm(net) before "
                  f"wrapping in DDP")


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


def check_evaluation(checks: Checks, result: Result, test_set: TensorDataset) -> None:
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


def check_accuracy(checks: Checks, result: Result, args: argparse.Namespace) -> None:
    defaults = parse_args([])
    measured = all(getattr(args, k) == getattr(defaults, k) for k in ("data", "epochs", "batch_size", "lr", "seed"))
    low, high = ACCURACY_BAND if measured else (0.5, 1.0)  # other settings: at least far better than chance
    acc = result.test["accuracy"]
    print0(f"test accuracy {acc:.3f} (band {low:.2f}-{high:.2f}) after {result.progress.global_step} steps")
    checks.expect(low <= acc <= high,
                  f"test accuracy {acc:.3f} is outside the band {low}-{high} (measured at 1, 2 and 4 ranks): "
                  f"check the train step (autocast, scaler.step, zero_grad) and the data split")


class StopsTheSave:
    """A value whose pickling raises `error`: a save stopped half-way, by an error or by Ctrl-C."""

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        raise self.error


def check_atomic_save(checks: Checks, directory: Path, me: Rank) -> None:
    """A save stopped half-way must leave the previous checkpoint readable and no file behind, and
    must let a KeyboardInterrupt (a BaseException, not an Exception) go on. Observed: the file at the
    path, every file of its folder, what the save raised."""
    directory = directory / f"atomic-check-rank{me.rank}"  # a folder of this rank's own: its listing is ours
    directory.mkdir(exist_ok=True)
    path = directory / f"atomic-check-rank{me.rank}.pt"
    good = {"value": torch.arange(5)}
    lab.save_checkpoint(path, good)
    before = {p.name for p in directory.iterdir()}
    for error, stopped_by in ((pickle.PicklingError("cannot be saved"), "an error"),
                              (KeyboardInterrupt(), "Ctrl-C (KeyboardInterrupt)")):
        raised = None
        try:
            lab.save_checkpoint(path, {"value": torch.arange(5), "stops the save": StopsTheSave(error)})
        except BaseException as caught:  # noqa: B036 - the save must fail: its state cannot be pickled
            raised = caught
        try:
            survived = torch.equal(torch.load(path, weights_only=True)["value"], good["value"])
        except Exception:
            survived = False
        leftovers = sorted({p.name for p in directory.iterdir()} - before)
        checks.expect(survived, f"a save stopped half-way by {stopped_by} destroyed the previous checkpoint: "
                                f"torch.save into a temporary file in the same folder, then os.replace it onto the path")
        if not checks.expect(not leftovers, f"a save stopped half-way by {stopped_by} left {leftovers} behind: delete "
                                            f"the temporary file whatever stops the save"
                                            + (" - except Exception does not catch KeyboardInterrupt: clean up in "
                                               "except BaseException (then raise) or in finally"
                                               if isinstance(error, KeyboardInterrupt) else "")):
            for name in leftovers:
                (directory / name).unlink(missing_ok=True)
        if isinstance(error, KeyboardInterrupt):
            what = type(raised).__name__ if raised else "it returned"
            checks.expect(isinstance(raised, KeyboardInterrupt),
                          f"save_checkpoint swallowed a KeyboardInterrupt ({what}): clean up, then raise it again, "
                          f"so that Ctrl-C still stops the run")
    path.unlink(missing_ok=True)

    unsafe = directory / f"unsafe-check-rank{me.rank}.pt"
    torch.save({"config": argparse.Namespace(a=1)}, unsafe)  # an arbitrary pickled object
    try:
        lab.read_checkpoint(unsafe, me.device)
        refused = False
    except Exception:
        refused = True
    unsafe.unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    checks.expect(refused, "read_checkpoint loaded an arbitrary pickled object: pass weights_only=True to "
                           "torch.load, so that a checkpoint cannot run code")


def small_training(me: Rank, seed: int, steps: int) -> tuple:
    """A tiny network with BatchNorm in DDP, SGD with momentum, a cosine schedule and an enabled
    GradScaler, after `steps` steps: every piece of state that a checkpoint carries."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    model = DDP(net.to(me.device), device_ids=[me.device.index] if me.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    scaler = torch.amp.GradScaler(me.device.type, init_scale=2.0 ** (8 + seed), growth_interval=1)
    for _ in range(steps):
        x, y = torch.randn(5, 1, 6, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        scaler.scale(F.cross_entropy(model(x.to(me.device)), y.to(me.device))).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model, optimizer, scheduler, scaler


def same(a, b) -> bool:
    """Equal, tensors and nested containers included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def prefix_mismatch(error: BaseException) -> str | None:
    """One line for load_state_dict's error when the keys differ by DDP's 'module.' prefix, else None."""
    text = str(error)
    if not isinstance(error, RuntimeError) or "Error(s) in loading state_dict" not in text or "module." not in text:
        return None
    first = lambda kind: next(iter(re.findall(kind + r' key\(s\) in state_dict: "([^"]+)"', text)), "?")
    expected, given = first("Missing"), first("Unexpected")
    if "for DistributedDataParallel" in text.splitlines()[0]:
        return (f"restore loaded the checkpoint's model weights into the DDP wrapper, whose keys start with "
                f"'module.' ('{expected}'), while the checkpoint's, saved from model.module, do not ('{given}'): "
                f"load into the bare network, model.module.load_state_dict(state['model'])")
    return (f"the checkpoint's model keys start with 'module.' ('{given}': saved from the DDP wrapper), the bare "
            f"network they are loaded into expects '{expected}': save model.module.state_dict() in the "
            f"checkpoint and load it with model.module.load_state_dict")


def check_restore(checks: Checks, me: Rank) -> None:
    """checkpoint_state, through a real save and load, then restore into fresh objects: every piece of
    state must be the checkpoint's again (tested directly: a resumed run would only show knock-on effects)."""
    saved = small_training(me, seed=1, steps=3)
    progress = Progress(epoch=1, step_in_epoch=8, global_step=30, loss_sum=12.5,
                            history=[{"epoch": 0, "train_loss": 1.5, "test_loss": 1.25, "test_accuracy": 0.75}])
    buffer = io.BytesIO()
    torch.save(lab.checkpoint_state(*saved, progress, me), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location=me.device, weights_only=True)
    fresh = small_training(me, seed=2, steps=0)
    try:
        got = lab.restore(state, *fresh)
    except RuntimeError as error:
        if (said := prefix_mismatch(error)) is None:
            raise
        checks.fail(said)
        return
    (model, optimizer, scheduler, scaler), (want_model, want_opt, want_sched, want_scaler) = fresh, saved
    weights = max_diff(flat_params(model), flat_params(want_model))
    checks.expect(weights == 0.0, f"after restore the weights differ from the checkpoint's (max diff {weights:.2e}): "
                                  f"model.module.load_state_dict(state['model'])")
    buffers = dict(model.module.named_buffers())
    checks.expect(weights != 0.0 or all(same(b, buffers[n]) for n, b in want_model.module.named_buffers()),
                  "after restore the weights are the checkpoint's but the BatchNorm running statistics are not: "
                  "load the model's whole state_dict (buffers too)")
    got_opt, want = optimizer.state_dict(), want_opt.state_dict()
    if not same(got_opt, want):
        momentum = sum(same(got_opt["state"].get(k), v) for k, v in want["state"].items())
        lr, want_lr = got_opt["param_groups"][0]["lr"], want["param_groups"][0]["lr"]
        checks.fail(f"after restore the optimizer's state is not the checkpoint's ({momentum} of {len(want['state'])} "
                    f"momentum buffers, learning rate {lr:.4g} instead of {want_lr:.4g}): a resumed run would step "
                    f"without the optimizer's momentum - optimizer.load_state_dict(state['optimizer'])")
    checks.expect(same(scheduler.state_dict(), want_sched.state_dict()),
                  f"after restore the learning-rate scheduler is at step {scheduler.last_epoch}, the checkpoint's "
                  f"at step {want_sched.last_epoch}: the schedule would start over - "
                  f"scheduler.load_state_dict(state['scheduler'])")
    checks.expect(same(scaler.state_dict(), want_scaler.state_dict()),
                  f"after restore the GradScaler's scale is {scaler.get_scale():g}, the checkpoint's "
                  f"{want_scaler.get_scale():g}: scaler.load_state_dict(state['scaler'])")
    checks.expect(is_dataclass(got) and asdict(got) == state["progress"],
                  f"restore returned {got!r}, the checkpoint holds {state['progress']}: return "
                  f"Progress(**state['progress'])")


class BatchLog:
    """train's before_step probe: records (epoch, step in epoch, global step, fingerprint of the batch)
    before each step. With `keep` (a checkpoint file) it also keeps each new content of that file, by the
    global step at which it appeared: the checkpoints a crash after any of those steps leaves behind."""

    def __init__(self, keep: Path | None = None):
        self.keep = keep
        self.records: list[tuple[int, int, int, str]] = []
        self.kept: dict[int, bytes] = {}
        self._seen: tuple[int, int] | None = None

    def __call__(self, progress, images: torch.Tensor, labels: torch.Tensor) -> None:
        if self.keep is not None and self.keep.exists():
            stat = self.keep.stat()
            if (stat.st_mtime_ns, stat.st_size) != self._seen:
                self._seen = (stat.st_mtime_ns, stat.st_size)
                self.kept[progress.global_step] = self.keep.read_bytes()
        digest = hashlib.blake2b(digest_size=8)
        for t in (images, labels):
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        self.records.append((progress.epoch, progress.step_in_epoch, progress.global_step, digest.hexdigest()))


def train_explained(checks: Checks, *args, **kwargs):
    """lab.train, with a checkpoint whose keys differ by 'module.' said in one line (None then)."""
    try:
        return lab.train(*args, **kwargs)
    except RuntimeError as error:
        if (said := prefix_mismatch(error)) is None:
            raise
        checks.fail(said)
        return None


def batch_order_after_resume(reference: BatchLog, resumed: BatchLog) -> str | None:
    """What went wrong in the batches a resumed run trained, compared with the uninterrupted run's; None if nothing."""
    at_step = {g: (epoch, step, fp) for epoch, step, g, fp in reference.records}
    first_seen = {}
    for epoch, step, _, fp in reference.records:
        first_seen.setdefault(fp, (epoch, step))
    for epoch, step, g, fp in resumed.records:
        if g not in at_step or at_step[g][2] == fp:
            continue
        want = at_step[g][:2]
        seen = first_seen.get(fp)
        at = f"at step {g} (epoch {epoch}, batch {step}) the resumed run trained"
        if seen is None:
            return (f"{at} a batch the uninterrupted run never trained: the epoch's order differs - "
                    f"call loader.sampler.set_epoch(epoch) before taking the epoch's batches")
        if seen < want:
            return (f"{at} batch {seen[1]} of epoch {seen[0]} again: the batches of the interrupted epoch done "
                    f"before the checkpoint are trained twice - skip the first progress.step_in_epoch of them "
                    f"(itertools.islice), do not restart the epoch")
        return (f"{at} batch {seen[1]} of epoch {seen[0]}, due later: batches were skipped - skip exactly the "
                f"progress.step_in_epoch batches already done (itertools.islice)")
    return None


def check_resume(checks: Checks, args: argparse.Namespace, me: Rank, reference: Result, batches: BatchLog) -> None:
    """Resume from the checkpoint a crash mid-epoch would have left (the uninterrupted run's, kept by
    `batches`), and compare with the uninterrupted run bit for bit. The causes come first (where it resumed, which batches it trained); the knock-on effects (the
    weights, the BatchNorm statistics) only when those are right."""
    steps_per_epoch = len(reference.loader)
    crash = steps_per_epoch * (args.epochs // 2) + steps_per_epoch // 2 + 3  # mid-epoch, past a checkpoint
    crash += 1 if crash % args.checkpoint_every == 0 else 0
    last_checkpoint = crash - crash % args.checkpoint_every
    run = argparse.Namespace(**{**vars(args), "out": str(Path(args.out) / "resume-check"), "fresh": False,
                                "progress": False, "kill_at_step": None})
    # A run crashed before step `crash` leaves the checkpoint the uninterrupted run wrote at
    # `last_checkpoint` (rank 0 kept it, `batches.kept`): put it where the resumed run looks, rather
    # than train a second run up to the crash.
    if me.is_main:
        ckpt = Path(run.out) / "checkpoint.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.unlink(missing_ok=True)
        if last_checkpoint in batches.kept:
            ckpt.write_bytes(batches.kept[last_checkpoint])
    print0(f"resume check: crashed before step {crash}, resuming from the checkpoint of step {last_checkpoint}")
    log = BatchLog()
    resumed = train_explained(checks, run, me, before_step=log)
    if resumed is None:
        return
    if not checks.expect(resumed.resumed_from == last_checkpoint,
                         f"the resumed run started at step {resumed.resumed_from}, the last checkpoint was at step "
                         f"{last_checkpoint}: restore Progress from the checkpoint"):
        return
    if (wrong := batch_order_after_resume(batches, log)) is not None:
        checks.fail(wrong)
        return
    left = reference.progress.global_step - last_checkpoint
    if not checks.expect(resumed.steps_run == left,
                         f"after resuming it trained {resumed.steps_run} steps, {left} were left: "
                         + ("batches were skipped - skip only" if resumed.steps_run < left else
                            "batches of the interrupted epoch are trained twice - skip")
                         + " the progress.step_in_epoch batches already done (itertools.islice)"):
        return
    diff = max_diff(flat_params(resumed.model), flat_params(reference.model))
    if not checks.expect(diff == 0.0,
                         f"the resumed run trained the same batches from the restored state, yet its final weights "
                         f"differ from the uninterrupted run's (max diff {diff:.2e}): a redone step drew differently "
                         f"- seed the augmentation from (seed, rank, epoch, step) and draw nothing else at random"):
        return
    buffers = max_diff(torch.cat([b.flatten().float() for b in resumed.model.module.buffers()]),
                       torch.cat([b.flatten().float() for b in reference.model.module.buffers()]))
    checks.expect(buffers == 0.0, f"the BatchNorm running statistics differ after resuming (max diff {buffers:.2e}): "
                                  f"restore the model's whole state_dict (buffers too)")


def main(checks: Checks) -> None:
    args = parse_args()
    me = join_group()
    print0(f"training on {me.world_size} rank(s), backend {me.backend}, autocast {amp_dtype(args, me)}")
    batches = BatchLog(keep=Path(args.out) / "checkpoint.pt" if me.is_main else None)
    result = train_explained(checks, args, me, before_step=batches)
    if result is None:
        return
    train_set, test_set = load_data(args)
    check_sharding(checks, result, len(train_set), args, me, batches)
    check_augment(checks, train_set, me)
    check_replicas(checks, result.model, train_set)
    check_amp_step(checks, me)
    check_evaluation(checks, result, test_set)
    check_accuracy(checks, result, args)
    check_atomic_save(checks, Path(args.out), me)
    check_restore(checks, me)
    if args.resume_check and not checks.failures:  # a fixed first failure may fix the rest: fail fast
        check_resume(checks, args, me, result, batches)
    print0(f"final weights, history and curves in {args.out}/")


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 11 (capstone)", init=False)
