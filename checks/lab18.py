"""The check of lab 18 (batch_scaling): it runs the code of labs/18_batch_scaling.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).

A known mistake (the *_MISTAKES tables) is named only when its recomputation predicts what was seen.
"""

from __future__ import annotations

import math
from itertools import product
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import lab_namespaces
from ringside.effects import Contract, unwaited_diagnosis, watch
from ringside.lab import ranks_count

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- noise_terms, against a direct float64 computation ----------------------------------------------


def micro_gradients(seed: int, ranks: int, micros: int, dim: int, dtype) -> list[list[torch.Tensor]]:
    """Every rank's micro-batch gradients: a common direction plus noise of about its size, so that
    |G|^2 and tr(Sigma)/B are of one order and a mistake in either shows."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(dim, generator=g, dtype=torch.float64)
    return [[(mu + 1.5 * torch.randn(dim, generator=g, dtype=torch.float64)).to(dtype) for _ in range(micros)]
            for _ in range(ranks)]


TERM_MISTAKES = {
    "twice": "the averaged gradient is divided by the number of micro-batches twice (ReduceOp.AVG already divides, "
             "or the sum was divided again): |G_big|^2 is then far too small",
    "summed": "the gradient was summed over the micro-batches but not divided: the norms of the summed gradient, "
              "not of the averaged one",
    "biased": "|G|^2 is |G_big|^2 itself: that estimate is biased upwards by tr(Sigma)/B_big - use "
              "(B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)",
    "own": "|G_small|^2 is the mean over this rank's micro-batches only: average the squared norms over every "
           "micro-batch of every rank (all-reduce them too), so that every rank has the same estimate",
    "unsquared": "the norms were not squared: the formulas take |G_small|^2 and |G_big|^2",
    "no_micros": "B_big left out the micro-batches: it is micro_batch x micro-batches per rank x ranks, not "
                 "micro_batch x ranks",
    "world": "the whole job's size was used for the group's: count the group's ranks (dist.get_world_size(group))",
    "sign": "tr(Sigma) has the wrong sign: (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big), both differences "
            "positive (B_small is the small batch)",
}


def terms(grads: list[list[torch.Tensor]], micro_batch: int, rank: int, world: int, kind: str = "right"):
    """(mean, g2, trace) in float64 from every rank's micro-batch gradients, or as `kind` (a TERM_MISTAKES key)
    would compute them; `world` is the job's size (for the mistake that counts it instead of the group's)."""
    every = [g.double() for r in grads for g in r]
    count = len(every) if kind != "world" else world * len(grads[0])
    mean = torch.stack(every).sum(0) / count
    small = sum(g.square().sum() for g in every) / count
    if kind == "own":
        small = sum(g.double().square().sum() for g in grads[rank]) / len(grads[rank])
    if kind == "twice":
        mean = mean / count
    if kind == "summed":
        mean = mean * count
    big = mean.square().sum()
    if kind == "unsquared":
        small, big = sum(g.norm() for g in every) / count, mean.norm()
    b_small = micro_batch
    b_big = micro_batch * (count if kind != "no_micros" else len(grads))
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    if kind == "biased":
        g2 = big
    if kind == "sign":
        trace = -trace
    return mean, g2, trace


def matches(got, want, dtype) -> bool:
    # Tolerance: float32 sums in another order, then a difference of two norms of one order (the
    # estimates cancel about one digit): 1e-4 relative in float32; 1e-10 in float64.
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    return all(isinstance(a, torch.Tensor) and a.shape == b.shape and
               torch.allclose(a.double().cpu(), b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))
               for a, b in zip(got, want))


def traffic_mistake(call: str, calls, grad: torch.Tensor, members: int) -> str | None:
    """The gradient's bytes once in all-reduces (and a few numbers), nothing else, every request waited for."""
    other = sorted({c.op for c in calls if c.family != "all_reduce"})
    sent = sum(c.bytes for c in calls if c.family == "all_reduce")
    grad_bytes = grad.numel() * grad.element_size()
    dtypes = sorted({str(c.dtype) for c in calls if c.family == "all_reduce" and c.dtype != grad.dtype})
    if dtypes:
        return (f"{call} all-reduced {dtypes} tensors for {grad.dtype} gradients: compute and return everything "
                f"in the gradients' dtype")
    if other:
        return f"{call} called {other}: the average is an all-reduce, as DDP's - the norms need nothing else"
    if members > 1 and sent < grad_bytes:
        return f"{call} all-reduced {sent} bytes for a gradient of {grad_bytes}: the ranks never share their gradients"
    if sent > grad_bytes + 128:
        return (f"{call} all-reduced {sent} bytes for a gradient of {grad_bytes}: the gradient's bytes once is "
                f"enough (the averaged gradient gives |G_big|^2; only the squared norms, a number per rank, go extra)")
    return unwaited_diagnosis(call, calls)


TERMS = Contract("noise_terms")  # changes none of its arguments


def check_terms_case(me: Rank, what: str, grads, position: int, micro_batch: int, dtype, group) -> str | None:
    mine = [g.to(me.device, copy=True) for g in grads[position]]  # on the rank's GPU under nccl
    seen = watch(TERMS, lab.noise_terms, mine, micro_batch, group, namespaces=lab_namespaces(lab))
    got, call = seen.result, f"noise_terms({what})"
    wrong = traffic_mistake(call, seen.calls, mine[0], len(grads)) or seen.problem
    if wrong is not None:
        return wrong
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return f"{call} returned {type(got).__name__}, not (mean, g2, trace)"
    want = terms(grads, micro_batch, position, me.world_size)
    shapes = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in got]
    if shapes != [(tuple(w.shape), dtype) for w in want]:
        return (f"{call} returned {shapes}: the mean gradient ({want[0].numel()},) and two 0-dim tensors, "
                f"all in the gradients' dtype {dtype}")
    if matches(got, want, dtype):
        return None
    names = ("the mean gradient", "g2", "trace")
    first = next(i for i in range(3) if not matches(got[i:i + 1], want[i:i + 1], dtype))
    seen = (f"{call}: {names[first]} is {got[first].double().norm() if first == 0 else got[first].item():.6g}, "
            f"a direct float64 computation gives {want[first].norm() if first == 0 else want[first].item():.6g}")
    for kind, words in TERM_MISTAKES.items():
        guess = terms(grads, micro_batch, position, me.world_size, kind)
        if not all(torch.allclose(a, b) for a, b in zip(guess, want)) and matches(got, guess, dtype):
            return f"{seen} - {words}"
    return seen + " - |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2)/(B_big - B_small), B_small = micro_batch"


def check_noise_terms(checks: Checks, me: Rank) -> bool:
    n = me.world_size
    cases = [  # (seed, micro-batches per rank, micro_batch, dim, dtype): never the lab's own (2 x 8)
        (1, 2 if n == 1 else 1, 8, 37, torch.float32),
        (2, 3, 5, 11, torch.float64),
    ]
    for seed, micros, micro_batch, dim, dtype in cases:
        grads = micro_gradients(seed, n, micros, dim, dtype)
        what = f"{micros} micro-batch(es) of {micro_batch} on each of {ranks_count(n)}, {dtype}"
        if not checks.settle(check_terms_case(me, what, grads, me.rank, micro_batch, dtype, None)):
            return False
    # Two subgroups side by side (ranks 0..k-1 and the rest): each must estimate from its own members only.
    parts = list(range((n + 1) // 2)), list(range((n + 1) // 2, n))
    groups = [dist.new_group(part) if part and n > 1 else None for part in parts]
    part = 0 if me.rank in parts[0] else 1
    members = parts[part]
    grads = micro_gradients(3 + part, len(members), 2, 9, torch.float64)
    what = f"2 micro-batches of 4 on a subgroup of ranks {members} of {n}, float64"
    if not checks.settle(check_terms_case(me, what, grads, members.index(me.rank), 4, torch.float64, groups[part])):
        return False
    # One micro-batch in a group of one: B_big = B_small, nothing to estimate from.
    singles = [dist.new_group([r]) for r in range(n)] if n > 1 else [None]
    single = singles[me.rank if n > 1 else 0]
    g = micro_gradients(5, 1, 1, 6, torch.float32)[0]
    wrong = None
    try:
        got = lab.noise_terms([g[0].to(me.device, copy=True)], 8, single)
        wrong = (f"noise_terms of one micro-batch in a group of one rank returned "
                 f"{[round(float(t), 4) if t.numel() == 1 else '...' for t in got]}: with B_big = B_small there is "
                 f"nothing to compare - raise ValueError")
    except ValueError:
        pass
    except Exception as error:
        wrong = (f"noise_terms of one micro-batch in a group of one rank raised {type(error).__name__} "
                 f"({str(error)[:60]}): check for it first and raise ValueError")
    if not checks.settle(wrong):
        return False
    print0("noise_terms: the mean gradient, |G|^2 and tr(Sigma) equal a direct float64 computation (float32 and "
           "float64, 1-3 micro-batches per rank" + (", two subgroups" if n > 1 else ": at 1 rank they stand in for ranks")
           + "); one micro-batch alone refused with ValueError")
    return True


# --- NoiseScale, against the ratio of two exponential averages --------------------------------------------

STEPS = [(-0.5, 4.0), (2.0, 10.0), (1.0, 30.0), (3.0, 6.0), (0.2, 8.0), (2.5, 12.0)]  # (g2, trace) per step


def scale_replay(beta: float, kind: str = "right") -> list[float]:
    g2 = trace = ratio = 0.0
    seen = []
    for t, (a, b) in enumerate(STEPS, start=1):
        w_old, w_new = (1 - beta, beta) if kind == "beta_swapped" else (beta, 1 - beta)
        g2, trace = w_old * g2 + w_new * a, w_old * trace + w_new * b
        ratio = beta * ratio + (1 - beta) * (b / a)
        if kind == "ratios":
            seen.append(ratio)
        elif kind == "one_corrected":
            seen.append(trace / (1 - beta ** t) / g2 if g2 > 0 else math.inf)
        elif kind == "no_inf":
            seen.append(trace / g2)
        else:
            seen.append(trace / g2 if g2 > 0 else math.inf)
    return seen


SCALE_MISTAKES = {
    "ratios": "the per-step ratios were averaged: average tr(Sigma) and |G|^2 apart, then divide once (a step's "
              "|G|^2 estimate near zero or negative would swamp an average of ratios)",
    "beta_swapped": "beta and 1 - beta are swapped: avg <- beta x avg + (1 - beta) x new",
    "one_corrected": "one average is bias-corrected and the other not: correct both or neither (the corrections "
                     "cancel in the ratio)",
    "no_inf": "value() divided by a |G|^2 average that is not positive: return inf then (no signal yet)",
}


def same(a: float, b: float) -> bool:
    # Tolerance: the same arithmetic in another order (bias-corrected or not): 1e-9 relative.
    return (math.isinf(a) and math.isinf(b) and a > 0 and b > 0) or (
        not math.isinf(b) and not math.isnan(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))


def check_noise_scale(checks: Checks, me: Rank) -> bool:
    wrong = None
    for beta in (0.8, lab.BETA):
        scale = lab.NoiseScale(beta)
        seen = []
        try:
            first = float(scale.value())
            for a, b in STEPS:
                scale.update(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
                seen.append(float(scale.value()))
        except ZeroDivisionError:
            wrong = "NoiseScale.value() divided by a zero |G|^2 average: return inf while it is not positive"
            break
        want = scale_replay(beta)
        if not (math.isinf(first) and first > 0):
            wrong = f"NoiseScale({beta}).value() before any update is {first}: both averages are 0 then - return inf"
            break
        if not all(same(s, w) for s, w in zip(seen, want)):
            step = next(i for i, (s, w) in enumerate(zip(seen, want)) if not same(s, w))
            fits = [w for k, w in SCALE_MISTAKES.items() if all(map(same, seen, scale_replay(beta, k)))]
            wrong = (f"NoiseScale({beta}) after update{STEPS[:step + 1]}: value() is {seen[step]:.6g}, the ratio of "
                     f"the two averages is {want[step]:.6g}" + "".join(f" - {w}" for w in fits[:1]))
            break
    if not checks.settle(wrong):
        return False
    print0(f"NoiseScale: the ratio of two exponential averages (beta 0.8 and {lab.BETA}), inf while the |G|^2 "
           f"average is not positive, over {len(STEPS)} steps")
    return True


# --- scaled_lr and ranks_to_use over grids --------------------------------------------------------------


def schedule(step, batch, base_lr, base_batch, warmup, rule, kind="right") -> float:
    ratio = batch / base_batch
    power = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}[rule]
    if kind == "twice":
        power *= 2
    if kind == "sqrt_linear" and rule == "sqrt":
        power = 1.0
    peak = base_lr * ratio ** power
    done = 1.0 if warmup == 0 else min(1.0, (step + (kind == "early")) / warmup)
    return peak * done if kind == "from_zero" else base_lr + (peak - base_lr) * done


LR_MISTAKES = {
    "early": "the warmup reaches its peak a step early: at step s the fraction done is s / warmup (base_lr at step 0)",
    "twice": "the scaling was applied twice (the batch ratio squared for linear, to the first power for sqrt)",
    "sqrt_linear": "rule \"sqrt\" scaled linearly: its peak is base_lr x sqrt(batch / base_batch)",
    "from_zero": "the warmup starts from 0: it starts from base_lr at step 0 (Goyal et al. ramp from the small "
                 "batch's rate to the large one's)",
}


def check_schedule(checks: Checks, me: Rank) -> bool:
    wrong = None
    grid = product((5, 1, 0, 3), ("linear", "sqrt", "none"), ((64, 16, 0.1), (48, 16, 0.05), (8, 32, 0.2)))
    for warmup, rule, (batch, base_batch, base_lr) in grid:
        for step in (0, 1, 2, warmup - 1, warmup, warmup + 4):
            if step < 0 or wrong:
                continue
            args = dict(step=step, batch=batch, base_lr=base_lr, base_batch=base_batch, warmup=warmup, rule=rule)
            call = "scaled_lr(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
            want = schedule(**args)
            try:
                got = float(lab.scaled_lr(**args))
            except ZeroDivisionError:
                wrong = f"{call} divided by zero: with warmup 0 the peak holds from step 0"
                continue
            if not math.isclose(got, want, rel_tol=1e-12):
                fits = [w for k, w in LR_MISTAKES.items() if math.isclose(got, schedule(**args, kind=k), rel_tol=1e-12)]
                wrong = f"{call} returned {got:.6g}, expected {want:.6g}" + "".join(f" - {w}" for w in fits[:1])
    if not checks.settle(wrong):
        return False
    print0("scaled_lr: none, linear and sqrt, warmups of 0, 1, 3 and 5 steps, batches above and below the base one")
    return True


def check_ranks_to_use(checks: Checks, me: Rank) -> bool:
    wrong = None
    for b_noise, per_rank, available in product((math.inf, 0.5, 39.9, 40.0, 100.0, 1000.0), (8, 5), (1, 4, 12)):
        want = available if math.isinf(b_noise) else max(1, min(available, int(b_noise // per_rank)))
        got = lab.ranks_to_use(b_noise, per_rank, available)
        if got != want and wrong is None:
            wrong = (f"ranks_to_use(b_noise={b_noise}, per_rank_batch={per_rank}, available={available}) "
                     f"returned {got}, expected {want}")
            if got == math.ceil(b_noise / per_rank) and not math.isinf(b_noise):
                wrong += (" - rounded up: n ranks make a global batch of n x per_rank_batch, which must "
                          "stay <= B_noise (round down)")
            elif got == 0:
                wrong += " - at least one rank trains, however small B_noise is"
            elif isinstance(got, int) and got > available:
                wrong += " - more ranks than are available"
    if not checks.settle(wrong):
        return False
    print0("ranks_to_use: the most ranks whose global batch stays <= B_noise, at least 1, at most those available")
    return True


# --- the lab's training against one process simulating every rank ---------------------------------------


def simulate(n: int, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    model = lab.make_model()
    params = list(model.parameters())
    data = [list(lab.batches(r, n, steps)) for r in range(n)]
    ema_g2 = ema_trace = 0.0
    seen = []
    for step in range(steps):
        grads = [[torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            torch.nn.functional.cross_entropy(model(x), y), params)]) for x, y in data[r][step]] for r in range(n)]
        mean, g2, trace = terms(grads, lab.MICRO, 0, n)
        ema_g2 = lab.BETA * ema_g2 + (1 - lab.BETA) * g2.item()
        ema_trace = lab.BETA * ema_trace + (1 - lab.BETA) * trace.item()
        lr = schedule(step, lab.MICRO * lab.MICROS * n, lab.BASE_LR, lab.BASE_BATCH, lab.WARMUP, "linear")
        with torch.no_grad():
            for p, g in zip(params, mean.split([p.numel() for p in params])):
                p.sub_((lr * g.view_as(p)).to(p.dtype))
        seen.append(ema_trace / ema_g2 if ema_g2 > 0 else math.inf)
    return [p.detach().clone() for p in params], seen


def check_train(checks: Checks, me: Rank) -> tuple[bool, float]:
    n, steps = me.world_size, 6
    model = lab.make_model().to(me.device)  # the model and its batches on the rank's GPU under nccl
    batches = ([(x.to(me.device), y.to(me.device)) for x, y in micros] for micros in lab.batches(me.rank, n, steps))
    seen = lab.train(model, batches, lab.NoiseScale(lab.BETA), "linear")
    params, want = simulate(n, steps)
    wrong = None
    # Tolerance: float32 gradients summed in another order, through 6 steps and the estimates' cancellation: 1e-3.
    if not all(math.isclose(a, b, rel_tol=1e-3) or (math.isinf(a) and math.isinf(b)) for a, b in zip(seen, want)):
        wrong = (f"train's B_noise after each of {steps} steps {[round(s, 1) for s in seen]} differs from one process "
                 f"simulating {ranks_count(n)} {[round(w, 1) for w in want]}")
    elif not all(torch.allclose(p.cpu(), q, rtol=1e-4, atol=1e-6) for p, q in zip(model.parameters(), params)):
        wrong = f"after {steps} steps of train the parameters differ from one process simulating {ranks_count(n)}"
    if not checks.settle(wrong):
        return False, math.nan
    batch = lab.MICRO * lab.MICROS
    print0(f"train: {steps} steps on the digits equal one process simulating {ranks_count(n)}; B_noise after them "
           f"about {seen[-1]:.0f} samples: ranks_to_use says {lab.ranks_to_use(seen[-1], batch, 16)} of 16 ranks at "
           f"{batch} samples each")
    return True, seen[-1]


def main(me: Rank, checks: Checks) -> None:
    torch.set_num_threads(1)
    for check in (check_noise_terms, check_noise_scale, check_schedule, check_ranks_to_use):
        if not check(checks, me):
            return
    check_train(checks, me)


def run(**learner) -> None:
    vars(lab).update(learner)
    run_lab(main, title="Lab 18 (batch_scaling)")
