"""The check of lab 09 (amp): it runs the code of labs/09_amp.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ringside import Checks, Rank, run_lab
from ringside.compare import all_gather_tensor, flat_params, max_diff
from ringside.data import digits

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The check, part 1: one iteration on known gradients, a fresh scaler each time ----------------

INIT_SCALE, GROWTH_INTERVAL = 2.0**12, 3
GROWTH, BACKOFF = 4.0, 0.125  # not GradScaler's defaults (2, 0.5), which fixed numbers in update() would pass;
# nor inverses of each other, so that growing or dividing on a skipped step is told apart
FACTORS = dict(growth_factor=GROWTH, backoff_factor=BACKOFF, growth_interval=GROWTH_INTERVAL)
PROBE_SCALE = 2.0**10  # a power of 2: scaling and unscaling are exact, so are the comparisons below
PROBE_A, PROBE_B = torch.tensor([3.0, -1.5, 0.25]), torch.tensor([0.5, 2.0, -8.0])


def one_iteration(grad_a: torch.Tensor, grad_b: torch.Tensor,
                  frozen: bool = False, scale: float = PROBE_SCALE) -> tuple[torch.Tensor, bool, float]:
    """One iteration (scale, backward, unscale_, step, update) of a fresh LossScaler at PROBE_SCALE,
    on two parameters whose gradients are grad_a and grad_b, each in a param group of its own
    (frozen: plus one that takes no part in the loss, its .grad None). Returns the gradients after
    unscale_, whether the step was taken (the weights moved), and the scale after update()."""
    a, b, unused = (nn.Parameter(torch.ones(3)) for _ in range(3))
    optimizer = torch.optim.SGD([{"params": [a]}, {"params": [b, unused] if frozen else [b]}], lr=0.1)
    scaler = lab.LossScaler(scale, **FACTORS)
    loss = (a * grad_a).sum() + (b * grad_b).sum()
    scaler.scale(loss - loss.detach()).backward()  # the loss's value is 0 unless a gradient is inf or NaN
    scaler.unscale_(optimizer)
    grads = torch.cat([p.grad.detach().clone() if p.grad is not None else torch.full((3,), float("nan"))
                       for p in (a, b)])
    before = torch.cat([a.detach(), b.detach()])
    scaler.step(optimizer)
    stepped = not torch.equal(before, torch.cat([a.detach(), b.detach()]))
    scaler.update()
    return grads, stepped, float(scaler.get_scale())


def without_unscale() -> tuple[torch.Tensor, torch.Tensor]:
    """Two iterations of one fresh LossScaler at PROBE_SCALE in a loop that never calls unscale_
    (scale, backward, step, update), with the gradient PROBE_A; the weights after each."""
    a = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([a], lr=0.5)
    scaler = lab.LossScaler(PROBE_SCALE, **FACTORS)
    weights = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = (a * PROBE_A).sum()
        scaler.scale(loss - loss.detach()).backward()
        scaler.step(optimizer)
        scaler.update()
        weights.append(a.detach().clone())
    return weights[0], weights[1]


def diagnose_one_iteration() -> str | None:
    """What one iteration on known gradients shows wrong, first the unscaling, then the finding of
    inf and NaN, then what step() and update() do with it; None when all is as GradScaler does."""
    s = PROBE_SCALE
    expected = torch.cat([PROBE_A, PROBE_B])
    grads, stepped, _ = one_iteration(PROBE_A, PROBE_B)

    def near(x: torch.Tensor, y: torch.Tensor) -> bool:  # tolerance: relative 1e-6 (the true values are exact)
        return bool(torch.allclose(x, y, rtol=1e-6, atol=0.0))

    if not near(grads, expected):
        if near(grads[:3], PROBE_A) and near(grads[3:], PROBE_B * s):
            return ("unscale_ divided the gradients of the optimizer's first param group, not those of the "
                    "second: loop over every group in optimizer.param_groups")
        if near(grads, expected * s):
            return (f"after unscale_ the gradients are still multiplied by the scale ({s:g}): unscale_ must "
                    f"divide every p.grad by the scale, in place - a divided copy in a local variable is lost")
        if near(grads, expected * s * s):
            return ("after unscale_ the gradients are multiplied by the scale twice: unscale_ must divide every "
                    "p.grad by the scale, not multiply")
        if near(grads, expected / s):
            return "after unscale_ the gradients are divided by the scale twice: divide each one once"
        return (f"after unscale_ the gradients are {[round(g, 4) for g in grads.tolist()]}, expected "
                f"{expected.tolist()} (backward's gradients divided by the scale {s:g}): unscale_ must divide "
                f"every p.grad by the scale, once")
    if not stepped:
        return ("your scaler skipped a step whose gradients were all finite (the weights did not move): skip only "
                "when a gradient is inf or NaN - is a test in unscale_ or step() the wrong way round?")
    # lr 0.5 and gradients that are multiples of 1/4: every weight below is exact in float32
    first, second = without_unscale()
    for t, (weights, start) in enumerate(((first, torch.ones(3)), (second, torch.ones(3) - 0.5 * PROBE_A))):
        if near(weights, start - 0.5 * PROBE_A):
            continue
        if near(weights, start - 0.5 * PROBE_A * s):
            return ("in a loop that does not call unscale_, step() took the step with gradients still multiplied "
                    "by the scale: step() must unscale (and test) first when unscale_ did not run in this iteration"
                    if t == 0 else
                    "in a loop that does not call unscale_, the first step was right, the second used gradients "
                    "still multiplied by the scale: step() thought they were unscaled already - does update() "
                    "reset self.unscaled?")
        return (f"in a loop that does not call unscale_, your weights after iteration {t + 1} are "
                f"{[round(w, 4) for w in weights.tolist()]}, GradScaler's {(start - 0.5 * PROBE_A).tolist()}: "
                f"step() must unscale exactly once per iteration, when unscale_ did not run")
    try:
        one_iteration(PROBE_A, PROBE_B, frozen=True)
    except NotImplementedError:
        raise
    except Exception as error:  # a finding, not a crash of the check
        return (f"unscale_ raised {type(error).__name__} ({str(error).strip()[:80]}) when a parameter has no "
                f"gradient (p.grad is None: it took no part in the loss, or it is frozen): skip those, as "
                f"GradScaler does")

    def planted(which: int, value: float) -> tuple[torch.Tensor, torch.Tensor]:
        pair = [PROBE_A.clone(), PROBE_B.clone()]
        pair[which][1] = value
        return pair[0], pair[1]

    cases = {
        "an inf in the first parameter's gradient": planted(0, float("inf")),
        "a NaN in the first parameter's gradient": planted(0, float("nan")),
        "an inf in the last parameter's gradient": planted(1, float("inf")),
        # 1e36 is finite in float32; times the scale it overflows to inf, while the loss stays 0
        "gradients that overflow once scaled": (torch.full((3,), 1e36), torch.full((3,), 1e36)),
    }
    seen = {what: one_iteration(*pair)[1:] for what, pair in cases.items()}
    noticed = {what: not stepped or scale < s for what, (stepped, scale) in seen.items()}
    inf_first, nan_first, inf_last, overflow = noticed.values()
    if not (inf_first or nan_first or inf_last):
        return ("your scaler neither skipped the step nor backed off on gradients holding an inf or a NaN: "
                "unscale_ found nothing - does it test every gradient (torch.isfinite), and keep the finding "
                "where step() and update() read it (self.found_inf), not in a local variable?")
    if not (inf_first or nan_first):
        return ("an inf or a NaN in the first parameter's gradient went unnoticed, an inf in the last one was "
                "found: the test of the next, finite parameter overwrote found_inf (combine the tests with `or`)")
    if not inf_first:
        return ("an inf in the gradients went unnoticed (the step was taken, the scale kept) while a NaN was "
                "found: unscale_ does not detect inf - test with torch.isfinite (inf and NaN), not torch.isnan")
    if not nan_first:
        return ("a NaN in the gradients went unnoticed (the step was taken, the scale kept) while an inf was "
                "found: a NaN is not an inf - test the gradients with torch.isfinite, not torch.isinf")
    if not overflow:
        return ("gradients of 1e36 (finite in float32) overflowed to inf once scaled, while the loss stayed "
                "finite, and your scaler took the step: test every gradient (after backward, in unscale_), not "
                "the loss")
    for what, (stepped, scale) in seen.items():
        if stepped:  # so the scale backed off: the finding was made
            return (f"with {what}, your scaler found it (the scale backed off) yet took the step: step() must "
                    f"not call optimizer.step() when unscale_ found an inf or a NaN")
        if scale > s:
            how = ("multiply the scale by backoff_factor, do not divide by it" if scale == s / BACKOFF else
                   "a skipped step backs off (backoff_factor), it never grows the scale (growth_factor)"
                   if scale == s * GROWTH else "it must fall, by backoff_factor")
            return (f"with {what}, your scaler skipped the step but the scale rose from {s:g} to {scale:g} "
                    f"(GradScaler: {s * BACKOFF:g}; backoff_factor {BACKOFF:g}): {how}")
        if scale == s:
            return (f"with {what}, your scaler skipped the step but the scale did not back off (it stayed "
                    f"{s:g}; GradScaler: {s * BACKOFF:g}): update() must multiply it by backoff_factor when this "
                    f"iteration found an inf or a NaN - or the finding was cleared (in step()?) before update() "
                    f"read it")
    # At a scale of 1 (a scale that has backed off all the way), gradients of 2**127: each element fits
    # float32, their sum does not. GradScaler tests each element and takes the step; a test of a sum
    # or a norm sees an inf that is not there.
    _, stepped, scale = one_iteration(torch.full((3,), 2.0**127), PROBE_B, scale=1.0)
    if not stepped or scale < 1.0:
        return (f"at a scale of 1, with gradients of {2.0**127:.3g} (each finite in float32, their sum is not) "
                f"your scaler skipped the step or backed off; GradScaler takes it: test each element "
                f"(torch.isfinite(g).all()), not a sum or a norm of the gradient, which overflows")
    return None


def check_one_iteration(checks: Checks) -> bool:
    """scale(), then one iteration on known gradients; the same on every rank."""
    probe = float(lab.LossScaler(INIT_SCALE).scale(torch.tensor(3.0)))
    if not checks.expect(probe == 3.0 * INIT_SCALE,
                         f"scale(loss) returned {probe:g} for a loss of 3 at a scale of {INIT_SCALE:g}; GradScaler "
                         f"returns {3.0 * INIT_SCALE:g}: the loss multiplied by the current scale, so that every "
                         f"gradient is"):
        return False
    problem = diagnose_one_iteration()
    return checks.expect(problem is None, f"one iteration on known gradients: {problem}")


# --- The check, part 2: one gradient sequence through both scalers --------------------------------

STEPS = 24
# Planted steps: an inf, a NaN, and gradients of 1e37, finite in float32 but inf once multiplied
# by any scale above about 34: the scaler must skip and back off at each of them.
PLANTED = {4: "an inf", 9: "a NaN", 15: "an overflow", 16: "an overflow", 17: "an overflow"}


def gradient_sequence(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(6, generator=g) * 10.0 ** float(torch.randint(-3, 3, (1,), generator=g)) for _ in range(STEPS)]
    grads[4][2] = float("inf")
    grads[9][0] = float("nan")
    for t in (15, 16, 17):
        grads[t] = torch.full((6,), 1e37)
    return grads


def replay(scaler, grads: list[torch.Tensor]) -> tuple[list[float], list[bool], list[torch.Tensor]]:
    """Train two parameter vectors with SGD on a loss whose gradient is g_t (its first 3 numbers for
    the first parameter, the last 3 for the second), through `scaler` (the usual order: scale,
    backward, unscale_, step, update). The planted inf and NaN sit in the first parameter only. The
    loss's value is 0 while g_t is finite: whether to skip must come from the gradients, never from
    the loss. Returns the scale after every update, whether every step was skipped (weights
    unchanged), and the weights (both parameters, concatenated) after it."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([a, b], lr=0.1)
    scales, skipped, weights = [], [], []
    for g in grads:
        optimizer.zero_grad()
        loss = (a * g[:3]).sum() + (b * g[3:]).sum()
        scaler.scale(loss - loss.detach()).backward()
        scaler.unscale_(optimizer)  # where gradient clipping would go
        before = torch.cat([a.detach(), b.detach()])
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        after = torch.cat([a.detach(), b.detach()])
        skipped.append(torch.equal(before, after))
        weights.append(after)
    return scales, skipped, weights


def scale_variants(grads: list[torch.Tensor]) -> dict[str, tuple[list[float], str]]:
    """The scale after every step as the classic update() mistakes compute it (one pass each, the
    skips following from the scale as in a real run), with the hint for each."""
    kinds = {
        "no reset after growth": "after a growth the count of clean steps must restart at 0 as well",
        "no reset after growth, >=": "after a growth the count of clean steps must restart at 0 as well (without "
                                     "the reset, `>=` grows the scale at every clean step after the first growth)",
        "grows one step late": "grow when the count of clean steps in a row reaches growth_interval "
                               f"({GROWTH_INTERVAL}), not one step later",
        "grows one step early": f"grow when the count of clean steps reaches growth_interval ({GROWTH_INTERVAL}), "
                                f"not one step earlier",
        "no reset after a skip": "after a skipped step the count of clean steps must restart at 0",
        "fixed factors": f"your scale moves by 2 and 0.5: use self.growth_factor and self.backoff_factor "
                         f"(here {GROWTH:g} and {BACKOFF:g}), not GradScaler's default numbers",
    }
    out = {}
    for kind, hint in kinds.items():
        scale, count, scales = INIT_SCALE, 0, []
        grow, back = (2.0, 0.5) if kind == "fixed factors" else (GROWTH, BACKOFF)
        for g in grads:
            if not bool(torch.isfinite(g * scale).all()):
                scale *= back
                count = 0 if kind != "no reset after a skip" else count
            else:
                count += 1
                due = {"grows one step late": count == GROWTH_INTERVAL + 1,
                       "no reset after growth, >=": count >= GROWTH_INTERVAL,
                       "grows one step early": count == GROWTH_INTERVAL - 1}.get(kind, count == GROWTH_INTERVAL)
                if due:
                    scale *= grow
                    count = count if kind.startswith("no reset after growth") else 0
            scales.append(scale)
        out[kind] = (scales, hint)
    return out


def diagnose_replay(mine, ref, grads) -> str | None:
    """The first step where the two runs part, and the likely mistake; None when they agree."""
    (scales, skipped, weights), (ref_scales, ref_skipped, ref_weights) = mine, ref
    for t in range(STEPS):
        what = f"step {t}" + (f" ({PLANTED[t]} in the gradients)" if t in PLANTED else "")
        nan = not bool(torch.isfinite(weights[t]).all())
        if nan:  # NaN is a finding of its own; the cause follows
            what += ": your weights are NaN or inf after it"
        if skipped[t] != ref_skipped[t]:
            if not ref_skipped[t]:
                return (f"{what}: your scaler skipped a step whose gradients were finite - is found_inf "
                        f"recomputed by every unscale_ and reset by update()?")
            if PLANTED.get(t) == "a NaN":
                return (f"{what}: GradScaler skips it, yours took the step - a NaN is not an inf: test the "
                        f"gradients with torch.isfinite, not torch.isinf")
            if PLANTED.get(t) == "an overflow":
                return (f"{what}: GradScaler skips it, yours took the step - the scaled gradients overflowed to "
                        f"inf while the loss stayed finite: test every gradient (after backward, in unscale_), "
                        f"not the loss")
            if PLANTED.get(t) == "an inf" and skipped[9]:
                return (f"{what}: GradScaler skips it, yours took the step, yet skipped the NaN at step 9 - "
                        f"unscale_ does not detect inf: test with torch.isfinite (inf and NaN)")
            return (f"{what}: GradScaler skips it, yours took the step - step() must not call "
                    f"optimizer.step() when unscale_ found an inf or a NaN; or unscale_ lost the finding: the "
                    f"inf sits in the first parameter, and the test of the next, finite one overwrote found_inf "
                    f"(combine the tests with `or`)")
        if nan:
            return (f"{what} - the optimizer stepped with gradients that were not finite: step() must skip "
                    f"when unscale_ found an inf or a NaN")
        if not skipped[t]:
            # Tolerance: the scales are powers of 2, so scaling and unscaling are exact; only SGD's
            # own float32 arithmetic could differ, and it is the same in both runs.
            gap = max_diff(weights[t], ref_weights[t])
            if gap > 1e-6:
                moved = (weights[t] - weights[t - 1] if t else weights[t] - 1).abs().max()
                ref_moved = (ref_weights[t] - ref_weights[t - 1] if t else ref_weights[t] - 1).abs().max()
                ratio = float(moved / ref_moved)
                if ratio > 2:
                    hint = ("the step used gradients still multiplied by the scale - unscale_ must divide "
                            "every p.grad by the scale, in place (p.grad.div_: a divided copy in a local "
                            "variable is lost)")
                elif ratio < 0.5:
                    hint = ("the gradients were divided by the scale twice - step() must not unscale again "
                            "when unscale_ already ran in this iteration")
                else:
                    hint = "check that unscale_ divides each gradient by the current scale exactly once"
                return f"{what}: your weights differ from GradScaler's by {gap:.2e} (tolerance 1e-6): {hint}"
        if scales[t] != ref_scales[t]:
            before = ref_scales[t - 1] if t else INIT_SCALE
            known = next((hint for kind, (trajectory, hint) in scale_variants(grads).items()
                          if trajectory[:t + 1] == scales[:t + 1]), None)
            if known:
                return f"{what}: your scale is {scales[t]:g}, GradScaler's {ref_scales[t]:g} - {known}"
            if ref_skipped[t] and scales[t] >= before:
                return (f"{what}: the scale did not back off after a skipped step (yours {scales[t]:g}, "
                        f"GradScaler's {ref_scales[t]:g}) - on inf or NaN multiply it by backoff_factor")
            if scales[t] > ref_scales[t]:
                # which event the count should have restarted after: the last one GradScaler saw
                last = next((u for u in range(t - 1, -1, -1)
                             if ref_scales[u] != (ref_scales[u - 1] if u else INIT_SCALE)), None)
                grew = last is not None and ref_scales[last] > (ref_scales[last - 1] if last else INIT_SCALE)
                return (f"{what}: your scale grew to {scales[t]:g} too early (GradScaler: {ref_scales[t]:g}) - "
                        + (f"after the growth at step {last} the count of clean steps must restart at 0 as well"
                           if grew else "after a skipped step the count of clean steps must restart at 0"))
            return (f"{what}: your scale is {scales[t]:g}, GradScaler's {ref_scales[t]:g} - grow when the count "
                    f"of clean steps in a row reaches growth_interval ({GROWTH_INTERVAL})")
    return None


def check_replay(checks: Checks) -> None:
    grads = gradient_sequence(seed=dist.get_rank())  # each rank tries its own sequence
    mine = replay(lab.LossScaler(INIT_SCALE, **FACTORS), [g.clone() for g in grads])
    ref = replay(torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, **FACTORS), [g.clone() for g in grads])
    problem = diagnose_replay(mine, ref, grads)
    checks.expect(problem is None, f"gradient replay: {problem}")
    if problem is None and dist.get_rank() == 0:
        print(f"replay: scales {' '.join(f'{s:g}' for s in ref[0])}")
        print(f"replay: skipped steps {[t for t, s in enumerate(ref[1]) if s]} - the same in both scalers")


# --- The check, part 3: DDP + autocast with each scaler, a poisoned batch on one rank -------------

TRAIN_STEPS, POISONED_STEP, BATCH = 8, 3, 16


def train_amp(scaler, device: torch.device) -> tuple[list[float], torch.Tensor]:
    """A few DDP steps under fp16 autocast (on the CPU too: its overflows are real); at POISONED_STEP
    the last rank's batch holds an inf. DDP averages the gradients, so the NaN reaches every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x_all, y_all = digits(n=TRAIN_STEPS * BATCH * world_size).tensors
    scales = []
    for step in range(TRAIN_STEPS):
        start = (step * world_size + rank) * BATCH
        x, y = x_all[start:start + BATCH].clone().to(device), y_all[start:start + BATCH].to(device)
        if step == POISONED_STEP and rank == world_size - 1:
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales, flat_params(model)


def check_ddp(checks: Checks, device: torch.device) -> None:
    rank = dist.get_rank()
    mine, my_weights = train_amp(lab.LossScaler(2.0**20, growth_interval=2), device)
    ref, ref_weights = train_amp(torch.amp.GradScaler(device.type, init_scale=2.0**20, growth_interval=2), device)
    finite = bool(torch.isfinite(my_weights).all())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (finite, mine))
    if not finite:  # NaN is a finding of its own, whatever the other ranks hold
        backed_off = mine[POISONED_STEP] < (mine[POISONED_STEP - 1] if POISONED_STEP else 2.0**20)
        if backed_off:
            cause = ("your scaler found the NaN (the scale backed off) yet stepped: step() must not call "
                     "optimizer.step() when unscale_ found an inf or a NaN")
        else:
            cause = ("your scaler never noticed the NaN (the scale did not back off): either step() does not "
                     "unscale (and test) again in a later iteration - does update() reset self.unscaled? - "
                     "or the test misses NaN (torch.isfinite, not torch.isinf)")
        checks.fail(f"DDP + autocast: your weights are NaN or inf after the {TRAIN_STEPS} steps (step "
                    f"{POISONED_STEP} had NaN gradients on every rank after DDP's all-reduce): {cause}")
        return
    checks.expect(mine == ref, f"DDP + autocast: your scales {mine} differ from GradScaler's {ref}")
    # Tolerance: the two runs do the same float operations; scales are powers of 2 (exact).
    gap = max_diff(my_weights, ref_weights)
    if mine == ref and gap > 1e-6:
        checks.fail(f"DDP + autocast: the scales agree, yet the weights differ from GradScaler's run by {gap:.2e} "
                    f"(tolerance 1e-6): the optimizer saw gradients not divided by the scale exactly once - does "
                    f"step() unscale when the loop never calls unscale_ (is self.unscaled reset by update())?")
    else:
        checks.expect(gap <= 1e-6, f"DDP + autocast: weights differ from GradScaler's run by {gap:.2e} "
                                   f"(tolerance 1e-6)")
    same = all(max_diff(my_weights, w.cpu()) == 0 for w in all_gather_tensor(my_weights.to(device)))
    if not same and len({tuple(s) for _, s in every}) > 1:
        checks.fail("the ranks' scales and weights differ after the poisoned step: only some ranks skipped it - "
                    "every rank must decide from its gradients (after DDP's all-reduce all are NaN), not from its "
                    "own loss or input")
    else:
        checks.expect(same, "the weights differ between ranks after the poisoned step - every rank must skip "
                            "the same steps")
    if rank == 0 and mine == ref:
        print(f"DDP + fp16 autocast on {device.type}: scales {' '.join(f'{s:g}' for s in ref)} "
              f"(step {POISONED_STEP} poisoned on rank {dist.get_world_size() - 1}, skipped on every rank)")


def check_scale_keeps_the_loss(checks: Checks) -> None:
    """scale(loss) returns a new tensor: the caller still logs (and may reuse) the loss it passed.
    Scaled in place, every logged loss comes out init_scale times too large, and training is right."""
    scaler = lab.LossScaler(init_scale=1024.0)
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2.0).sum()
    scaled = scaler.scale(loss)
    checks.expect(loss.item() == 6.0, f"scale(loss) changed the caller's loss in place (6 became {loss.item():g}): "
                                      f"the training loop logs that loss, now {loss.item() / 6:g}x too large - "
                                      f"return a new tensor, loss * scale, as GradScaler.scale does")
    checks.expect(torch.is_tensor(scaled) and scaled.requires_grad and scaled.item() == 6.0 * 1024,
                  f"scale(loss) of a loss of 6 at scale 1024 returned {scaled!r}, not a tensor of 6144 that "
                  f"backward() can run through")


def main(me: Rank, checks: Checks) -> None:
    if not check_one_iteration(checks):  # the same verdict on every rank
        return  # the replay and the DDP run would only report the same mistake in other words
    check_scale_keeps_the_loss(checks)
    check_replay(checks)
    check_ddp(checks, me.device)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 09 (amp)")
