"""The check of lab 13 (sharding): it runs the code of labs/13_sharding.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import collections
import inspect
import types
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder, lab_namespaces
from ringside.effects import Contract, ignored, on_rank_gpu, watch
from ringside.compare import all_gather_tensor, flat_grads, flat_params, max_diff
from ringside.lab import everyone, ranks_count

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The check ------------------------------------------------------------------------------------

# What each function promises besides its values (ringside.effects checks it on every watched call).
AVERAGE = Contract("average_grad_shard", like="flat_grad")
ADAM = Contract("adam_update", changes=("param", "exp_avg", "exp_avg_sq"),
                honours={"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-3})
GATHER = Contract("gather_params", changes=("params",))

# What each collective sends per rank on a ring, as a fraction of the whole tensor S it works on
# (chapter 04): all-reduce 2(N-1)/N * S; reduce-scatter and all-gather (N-1)/N * S each.
def ring_bytes_sent(calls, world_size: int) -> float:
    """Bytes each rank sends for these calls if every collective runs as a ring."""
    share = (world_size - 1) / world_size
    return sum((2 * share if name == "all_reduce" else share) * size for name, size in calls)


def check_flatten(checks: Checks, me: Rank) -> bool:
    # 13 elements need padding at 2, 3 and 4 ranks; 3 * world_size elements need none, which is
    # where padding "up to world_size" instead of "up to the next multiple" shows.
    for sizes in ((7, 5, 1), (2 * me.world_size, me.world_size)):
        if not flattens_right(checks, me, sizes):
            return False
    return True


def flattens_right(checks: Checks, me: Rank, sizes: tuple[int, ...]) -> bool:
    tensors = [torch.arange(1.0, n + 1.0, device=me.device).reshape(-1) for n in sizes]
    flat = lab.flatten_padded(tensors, me.world_size).cpu()
    real = torch.cat([t.cpu() for t in tensors])
    total = real.numel()
    want = -(-total // me.world_size) * me.world_size
    if flat.numel() != want:
        why = ("a multiple of world_size, but pad only up to the NEXT one (no zeros when the total already is one: "
               "missing = -total % world_size)" if flat.numel() % me.world_size == 0
               else "pad with zeros so that every shard has the same size (reduce-scatter and all-gather need equal chunks)")
        return checks.expect(False, f"flatten_padded of {total} elements at {ranks_count(me.world_size)} returned "
                                    f"{flat.numel()} elements, expected {want}: {why}")
    ok = torch.equal(flat[:total], real)
    checks.expect(ok, "flatten_padded changed the order or the values: the tensors must come first, flattened, in order")
    pad_ok = bool((flat[total:] == 0).all())
    checks.expect(pad_ok, "flatten_padded's padding is not zeros: use zeros (torch.empty holds garbage, "
                          "and garbage can be NaN)")
    return ok and pad_ok


def check_shard_range(checks: Checks, me: Rank) -> bool:
    ok = True
    for numel in (985, 13, me.world_size * 5):
        mine = tuple(int(v) for v in lab.shard_range(numel, me.rank, me.world_size))
        ranges = [None] * me.world_size
        dist.all_gather_object(ranges, mine)
        size = -(-numel // me.world_size)
        padded = size * me.world_size
        expected = [(r * size, (r + 1) * size) for r in range(me.world_size)]
        if ranges == expected:
            continue
        ok = False
        covered = collections.Counter(i for start, stop in ranges for i in range(max(start, 0), stop))
        skipped = [i for i in range(numel) if not covered[i]]
        repeated = sorted(i for i, times in covered.items() if times > 1)
        if sorted(ranges) == expected:
            swapped = next(r for r in range(me.world_size) if ranges[r] != expected[r])
            checks.fail(f"shard_range({numel}): rank {swapped} took the shard {ranges[swapped]}, which belongs to rank "
                        f"{expected.index(ranges[swapped])} - wrong shard for this rank: reduce-scatter hands rank r "
                        f"the r-th chunk, {expected[swapped]}")
        elif repeated:
            checks.fail(f"shard_range({numel}): the shards repeat elements (element {repeated[0]} lies in two shards) - "
                        f"rank r's shard is [r * size, (r + 1) * size), the stop excluded")
        elif skipped:
            checks.fail(f"shard_range({numel}) at {ranks_count(me.world_size)}: the shards skip {len(skipped)} element(s) "
                        f"(the first is {skipped[0]}) - round the shard size UP (the padding makes room), "
                        f"size = ceil({numel} / {me.world_size}) = {size}")
        elif ranges[:-1] == expected[:-1] and ranges[-1] == (expected[-1][0], numel):
            checks.fail(f"shard_range({numel}): the last shard stops at {numel}, cut short - the shards split the "
                        f"PADDED vector ({padded} elements), so every shard has {size} elements, the last one too "
                        f"(reduce-scatter hands out equal chunks)")
        elif len({stop - start for start, stop in ranges}) == 1 and ranges[0][1] - ranges[0][0] > size:
            checks.fail(f"shard_range({numel}) at {ranks_count(me.world_size)}: the shards have {ranges[0][1] - ranges[0][0]} "
                        f"elements, more than ceil({numel} / {me.world_size}) = {size} - numel // world_size + 1 "
                        f"overshoots when numel is a multiple of world_size: size = -(-numel // world_size)")
        else:
            checks.fail(f"shard_range({numel}) gave {ranges}, expected {expected}: equal shards in rank order")
        break
    return ok


def check_average(checks: Checks, me: Rank) -> bool:
    n = -(-37 // me.world_size) * me.world_size
    torch.manual_seed(lab.SEED)
    everyones = torch.randn(me.world_size, n)  # rank r's gradient is row r: the check knows them all
    seen = watch(AVERAGE, lab.average_grad_shard, everyones[me.rank].to(me.device), namespaces=lab_namespaces(lab))
    if seen.problem:  # a request never waited for, the caller's gradient changed: named before any value
        return checks.expect(False, seen.problem)
    shard, calls = seen.result.cpu(), [(c.op, c.whole_bytes) for c in seen.calls]
    size = n // me.world_size
    expected = everyones.mean(dim=0)[me.rank * size:(me.rank + 1) * size]
    names = [name for name, _ in calls]
    if "all_reduce" in names:
        extra = ring_bytes_sent(calls, me.world_size) - ring_bytes_sent([("reduce_scatter_tensor", n * 4)], me.world_size)
        checks.fail(f"average_grad_shard called all_reduce: it sends 2(N-1)/N of the gradient from each rank "
                    f"(on this check's {n}-element float32 test gradient at {me.world_size} ranks: {extra:.0f} "
                    f"bytes more from each rank than one reduce-scatter) and leaves every rank the whole "
                    f"average - ZeRO uses reduce-scatter, so each rank receives only the shard it updates")
        return False
    if not any(name.startswith("reduce_scatter") for name in names):
        checks.fail(f"average_grad_shard made no reduce-scatter (calls seen: {names or 'none'}): every rank must "
                    f"receive the average of its own shard of the gradient - dist.reduce_scatter_tensor")
        return False
    if shard.shape != expected.shape:
        return checks.expect(False, f"average_grad_shard returned {tuple(shard.shape)} elements, expected this rank's "
                                    f"shard of {size} (the padded length / world_size)")
    if torch.isnan(shard).any():
        return checks.expect(False, "average_grad_shard returned NaN")
    # Tolerance: the same sums in another order, float32: about 1e-7 relative; 1e-5 absolute on values of about 1.
    gap = max_diff(shard, expected)
    if gap <= 1e-5:
        return checks.expect(True, "")
    ratio = float(shard @ expected / (expected @ expected))  # the scale of what came back
    if abs(ratio - me.world_size) < 0.01:
        checks.fail(f"the gradient shard is {me.world_size}x the average: it is the sum - average it "
                    f"(op=dist.ReduceOp.AVG). Adam hardly notices the scale of its gradient, so the "
                    f"training check alone would miss this")
    elif abs(ratio - 1 / me.world_size) < 0.01:
        checks.fail(f"the gradient shard is 1/{me.world_size} of the average - averaged twice (ReduceOp.AVG and "
                    f"a division by world_size)? Adam hardly notices the scale, so training alone would miss it")
    else:
        checks.fail(f"average_grad_shard differs from the average of the ranks' gradient shards by {gap:.2e} "
                    f"(tolerance 1e-5): is it this rank's shard, rank r taking the r-th chunk?")
    return False


def check_adam(checks: Checks, me: Rank) -> bool:
    """Your adam_update against torch.optim.Adam on one tensor, for three steps, at the lab's
    hyper-parameters and at others (an argument read from a constant instead shows there)."""
    wrong = adam_mistake(me, lab.LR, lab.BETAS, lab.EPS)
    other = ADAM.honours
    if wrong is None and adam_mistake(me, other["lr"], other["betas"], other["eps"]):
        start, grad = torch.randn(50, generator=torch.Generator().manual_seed(3)), torch.full((50,), 1e-4)

        def moved(a: dict) -> torch.Tensor:
            lab.adam_update(*a.values())
            return a["param"]
        names = ignored(moved, dict(param=start.to(me.device), grad=grad.to(me.device), exp_avg=torch.zeros_like(start),
                                    exp_avg_sq=torch.zeros_like(start), t=1, lr=lab.LR, betas=lab.BETAS, eps=lab.EPS),
                        other)
        wrong = (f"adam_update ignores its argument(s) {', '.join(names)}: called with "
                 f"{', '.join(f'{k}={other[k]}' for k in names)} it moves param exactly as with the lab's "
                 f"{', '.join(f'{k}={v}' for k, v in zip(('lr', 'betas', 'eps'), (lab.LR, lab.BETAS, lab.EPS)) if k in names)}"
                 f" - use the values it is given (ShardedAdam may have others)" if names else
                 f"adam_update is torch.optim.Adam's at lr={lab.LR}, betas={lab.BETAS}, eps={lab.EPS}, but differs "
                 f"from it at lr={other['lr']}, betas={other['betas']}, eps={other['eps']}")
    return checks.expect(wrong is None, wrong or "")


def adam_mistake(me: Rank, lr: float, betas: tuple[float, float], eps: float) -> str | None:
    torch.manual_seed(lab.SEED + 1)
    # Gradients from 1e-6 to 1 in size: where grad**2 is as small as eps, eps's place in the formula shows.
    scale = 10.0 ** torch.linspace(-6, 0, 50)
    start, grads = torch.randn(50), [torch.randn(50) * scale for _ in range(3)]
    reference = nn.Parameter(start.clone())
    adam = torch.optim.Adam([reference], lr=lr, betas=betas, eps=eps)
    param = start.clone().to(me.device)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    for t, grad in enumerate(grads, start=1):
        reference.grad = grad.clone()
        adam.step()
        before = param.cpu().clone()  # .cpu() of a CPU tensor is that tensor, which adam_update moves
        seen = watch(ADAM, lab.adam_update, param, grad.to(me.device), exp_avg, exp_avg_sq, t, lr, betas, eps)
        if seen.problem:
            return seen.problem
        if torch.isnan(param).any():
            return (f"adam_update made NaN at step {t}: is the bias correction 1 - beta**t "
                    f"with t >= 1 (1 - beta**0 = 0)?")
        state = adam.state[reference]
        wrong = moments_mistake(exp_avg.cpu(), exp_avg_sq.cpu(), state, scale, t, betas)
        if wrong:
            return wrong
        # Tolerance: the same formula in float32, perhaps in another order: about 1e-7 relative on
        # weights of about 1; a wrong formula moves them by about LR = 1e-2.
        gap = max_diff(param.cpu(), reference.detach())
        if gap > 1e-6:
            return (f"adam_update differs from torch.optim.Adam by {gap:.2e} after step {t} (tolerance 1e-6): "
                    f"{update_mistake(before, param.cpu(), state, t, lr, betas, eps)}")
    return None


def moments_mistake(exp_avg, exp_avg_sq, state, scale, t: int, betas) -> str | None:
    """What is wrong with the moments after step t, or None when they are torch.optim.Adam's."""
    # Tolerance: 1e-5 relative to the element's own size and its gradient's (float32 rounding is
    # about 1e-7 of the terms added, even where they nearly cancel).
    def near(mine, theirs, size):
        return bool(((mine - theirs).abs() <= 1e-5 * (theirs.abs() + size)).all())

    untouched = [name for name, m in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)) if not m.any()]
    if untouched:
        return (f"after adam_update {' and '.join(untouched)} still hold zeros: `exp_avg = ...` makes a new tensor "
                f"the optimizer never sees - update the moments in place (exp_avg.lerp_, exp_avg_sq.mul_().addcmul_)")
    beta1, beta2 = betas

    def why(mine, theirs, beta, other, size, name) -> str:
        # Each known mistake scales Adam's moment by a factor that step 1 (from zeros) shows alone.
        known = [(1 / (1 - beta ** t), "the moments keep the raw averages: the bias correction goes into the step "
                                       "only, not into them")]
        if t == 1:
            known += [(beta / (1 - beta), f"the weights are swapped: the new average keeps {name} of the old one "
                                          f"and takes 1 - {name} of the new value"),
                      ((1 - other) / (1 - beta), "beta1 and beta2 are swapped: beta1, beta2 = betas")]
        return next((f" ({text})" for factor, text in known if near(mine, theirs * factor, size)), "")

    if not near(exp_avg, state["exp_avg"], scale):
        return (f"exp_avg differs from torch.optim.Adam's after step {t}: exp_avg = beta1 * exp_avg + (1 - beta1) * "
                f"grad, beta1 = betas[0] = {beta1}" + why(exp_avg, state["exp_avg"], beta1, beta2, scale, "beta1"))
    if not near(exp_avg_sq, state["exp_avg_sq"], scale ** 2):
        return (f"exp_avg_sq differs from torch.optim.Adam's after step {t}: exp_avg_sq = beta2 * exp_avg_sq + "
                f"(1 - beta2) * grad * grad, beta2 = betas[1] = {beta2}"
                + why(exp_avg_sq, state["exp_avg_sq"], beta2, beta1, scale ** 2, "beta2"))
    return None


def update_mistake(before, after, state, t: int, lr, betas, eps) -> str:
    """Which known wrong update of the weights turns `before` into `after`, from the right moments."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    correction1, correction2 = 1 - betas[0] ** t, (1 - betas[1] ** t) ** 0.5
    known = (
        ("adam_update did not move param: `param = ...` rebinds the name only - move it in place "
         "(param.addcdiv_ or param.sub_)", before),
        ("the bias correction is missing: divide the step by 1 - beta1**t and sqrt(v) by sqrt(1 - beta2**t)",
         before - lr * m / (v.sqrt() + eps)),
        ("the step goes uphill: subtract the update from param (value=-step_size), do not add it",
         before + lr / correction1 * m / (v.sqrt() / correction2 + eps)),
        ("eps belongs outside the square root: sqrt(v / (1 - beta2**t)) + eps",
         before - lr / correction1 * m / (v / correction2 ** 2 + eps).sqrt()),
        ("add eps after the bias correction: sqrt(v) / sqrt(1 - beta2**t) + eps, not (sqrt(v) + eps) / sqrt(...)",
         before - lr / correction1 * m / ((v.sqrt() + eps) / correction2)),
    )
    for why, then in known:
        if max_diff(after, then) <= 1e-6:
            return why
    return "compare your update with the formulas of torch.optim.Adam (in the hints)"


def check_gather(checks: Checks, me: Rank) -> bool:
    """Each rank's shard holds (rank + 1) * 1000 + position: after gather_params the parameters must
    hold every rank's shard, in rank order, on every rank."""
    shapes = [(3, 4), (5,), (2,)]  # 19 elements: padded at 2, 3 and 4 ranks
    params = [nn.Parameter(torch.zeros(s, device=me.device)) for s in shapes]
    size = -(-19 // me.world_size)
    shard = torch.arange(size, dtype=torch.float32, device=me.device) + (me.rank + 1) * 1000
    expected = torch.cat([torch.arange(size, dtype=torch.float32) + (r + 1) * 1000 for r in range(me.world_size)])[:19]
    try:
        seen = watch(GATHER, lab.gather_params, shard, params, namespaces=lab_namespaces(lab))
    except RuntimeError as error:
        text = str(error).strip().splitlines()[0]
        hint = (" - strip the padding: keep the first numel elements of the gathered vector before splitting"
                if "split" in text
                else " - copy_ needs the parameter's shape: reshape each slice first (new.view_as(p))"
                if "must match the size" in text
                else " - strip the padding: keep the first numel elements, split them by the parameters' numel()"
                if "size" in text or "shape" in text else "")
        return checks.expect(False, f"gather_params raised RuntimeError: {text}{hint}")
    if seen.problem:  # a request never waited for, the shard changed: named before any value
        return checks.expect(False, seen.problem)
    calls = [(c.op, c.whole_bytes) for c in seen.calls]
    got = flat_params(nn.ParameterList(params))
    if not any(name.startswith("all_gather") for name, _ in calls) and torch.equal(got, expected):
        sent, gather = ring_bytes_sent(calls, me.world_size), ring_bytes_sent([("all_gather", size * me.world_size * 4)],
                                                                              me.world_size)
        return checks.expect(sent <= gather, f"gather_params gives every rank every shard, but with {[n for n, _ in calls]}: "
                                             f"{sent:.0f} bytes sent per rank on a ring where one all-gather of the "
                                             f"shards sends {gather:.0f} ({sent / gather:.2g}x) - all-gather the "
                                             f"updated shards (dist.all_gather_into_tensor)")
    if not any(name.startswith("all_gather") for name, _ in calls):
        return checks.expect(False, f"gather_params made no all-gather (calls seen: {[n for n, _ in calls] or 'none'}): "
                                    f"each rank updated only its own shard, the others stay stale - all-gather "
                                    f"the updated shards (dist.all_gather_into_tensor)")
    if torch.equal(got, expected):
        return checks.expect(True, "")
    if torch.equal(got[-19:], torch.cat([expected, expected])[-19 - (size * me.world_size - 19):][:19]):
        return checks.expect(False, "gather_params took the wrong end of the gathered vector: the padding sits "
                                    "at the END, keep the first numel elements")
    return checks.expect(False, f"after gather_params rank {me.rank}'s parameters are not every rank's shard in rank "
                                f"order (first difference at element {int((got != expected).nonzero()[0])}): "
                                f"all-gather the shards, drop the padding at the end, copy in parameter order")


# What an optimizer holds is every tensor reachable from it (its attributes, an inner optimizer's
# state, lists, dicts), counted by the memory it keeps alive: a view keeps its whole storage.
LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType, weakref.ref, torch.dtype,
          torch.device, torch.Generator)


def held_tensors(root, limit: int = 100_000) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes, slots, dicts (keys too), lists, tuples and
    sets (modules too: a ParameterList of moments is state; the model's own parameters are left out
    by the caller)."""
    found, seen, todo = [], set(), [root]
    while todo and len(seen) < limit:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, LEAVES):
            continue
        elif isinstance(value, dict):
            todo += list(value.keys()) + list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
            todo += list(value)
        else:
            todo += list(getattr(value, "__dict__", {}).values())
            todo += [getattr(value, name) for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())
                     if isinstance(name, str) and hasattr(value, name)]
    return found


def state_memory(optimizer, params, shard: torch.Tensor) -> tuple[int, int, int]:
    """(bytes of the memory the optimizer keeps alive, bytes of it that are a copy of this rank's
    parameter shard `shard`, bytes of it that no tensor it holds looks at: views of something larger),
    the parameters' and their gradients' own memory left out."""
    theirs = {t.untyped_storage().data_ptr() for p in params for t in (p, p.grad) if t is not None}
    storages, seen, copies = {}, {}, set()
    for t in held_tensors(optimizer):
        storage = t.untyped_storage()
        if storage.data_ptr() in theirs or storage.nbytes() == 0:
            continue
        storages[storage.data_ptr()] = storage.nbytes()
        seen[storage.data_ptr()] = seen.get(storage.data_ptr(), 0) + t.numel() * t.element_size()
        if t.numel() == shard.numel() and torch.equal(t.detach().reshape(-1).cpu().to(shard.dtype), shard):
            copies.add(storage.data_ptr())
    unseen = sum(max(0, n - seen[k]) for k, n in storages.items())
    return sum(storages.values()), sum(storages[k] for k in copies), unseen


def check_state(checks: Checks, me: Rank, optimizer: lab.ShardedAdam, model, adam_bytes: int) -> bool:
    """After a step: the memory your optimizer keeps alive against torch.optim.Adam's two moments
    (measured on the DDP reference): two moments of one shard, and at most one copy of the shard."""
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    size = -(-numel // me.world_size)
    shard = padded_shard(flat_params(model), size * me.world_size, me.rank * size, (me.rank + 1) * size)
    mine, copy, unseen = state_memory(optimizer, params, shard)
    element = params[0].element_size()
    everyone_bytes = [None] * me.world_size
    dist.all_gather_object(everyone_bytes, mine)
    print0(f"optimizer state per rank: {everyone_bytes} bytes; torch.optim.Adam under DDP: {adam_bytes} bytes "
           f"on every rank (ratio {everyone_bytes[0] / adam_bytes:.3f}, 1/N = {1 / me.world_size:.3f})")
    # Two moments of one padded shard, plus a copy of the shard where the optimizer keeps one (an inner
    # torch.optim optimizer steps a copy), plus a few scalars (an inner Adam's step counts).
    allowed = 2 * size * element + copy + 256
    if mine <= allowed:
        return checks.expect(True, "")
    if mine - unseen <= allowed:
        return checks.expect(False, f"your optimizer keeps {mine} bytes alive on this rank, {unseen} of them in no "
                                    f"tensor it holds: a moment (or a shard) is a view of a larger tensor, whose "
                                    f"whole memory the view keeps alive - create it at its own size (or .clone() "
                                    f"the slice)")
    if mine - copy >= adam_bytes:
        return checks.expect(False, f"your optimizer keeps {mine} bytes alive on this rank, as much as Adam for the "
                                    f"whole model ({adam_bytes}): keep exp_avg and exp_avg_sq for this rank's shard "
                                    f"only ({size} elements each), not for all parameters")
    return checks.expect(False, f"your optimizer keeps {mine} bytes alive on this rank"
                                f"{f' ({copy} of them a copy of its parameter shard)' if copy else ''}; about "
                                f"1/{me.world_size} of Adam's {adam_bytes} is expected (two moments of {size} "
                                f"elements{', and the copy' if copy else ''}): a tensor as large as the model, or a "
                                f"view of one, keeps the whole of it alive")


def moments_shape_mistake(optimizer: lab.ShardedAdam, shard: int) -> str | None:
    """What is wrong with the moments ShardedAdam created (two tensors of one shard each), or None."""
    moments = {name: getattr(optimizer, name, None) for name in ("exp_avg", "exp_avg_sq")}
    if not all(isinstance(m, torch.Tensor) for m in moments.values()):
        return None  # named otherwise: the step will say what is missing
    a, b = moments["exp_avg"], moments["exp_avg_sq"]
    if (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one memory, overlapping elements
            and a.storage_offset() < b.storage_offset() + b.numel() and b.storage_offset() < a.storage_offset() + a.numel()):
        return ("exp_avg and exp_avg_sq are one tensor: `a = b = torch.zeros(...)` (or b = a) makes one, and "
                "each moment's update then overwrites the other - create two (torch.zeros_like)")
    for name, m in moments.items():
        if m.numel() != shard:
            whole = (" (one per parameter of the model: keep them for this rank's shard only, not for all "
                     "parameters)" if m.numel() >= optimizer.numel else "")
            return (f"{name} has {m.numel()} elements, but this rank's shard has {shard} (stop - start, the padded "
                    f"shard, rounded up){whole}: create the moments with stop - start elements")
    return None


def check_moments_follow_params(checks: Checks, me: Rank) -> bool:
    """The moments take the parameters' dtype and device: float64 parameters here (a float32 moment
    passes on a float32 CPU model, and loses precision, or fails on a GPU, elsewhere)."""
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(7, generator=generator, dtype=torch.float64).to(me.device)),
              nn.Parameter(torch.randn(3, generator=generator, dtype=torch.float64).to(me.device))]
    optimizer = lab.ShardedAdam(params)
    moments = {name: getattr(optimizer, name, None) for name in ("exp_avg", "exp_avg_sq")}
    if not all(isinstance(m, torch.Tensor) for m in moments.values()):
        return True  # named otherwise: the training step will say what is missing
    for name, m in moments.items():
        if m.dtype != torch.float64 or m.device != params[0].device:
            return checks.expect(False, f"for float64 parameters on {params[0].device}, {name} is {str(m.dtype)[6:]} on "
                                        f"{m.device}: create the moments with the parameters' dtype and device "
                                        f"(dtype= and device= of the first parameter; torch.zeros(n) alone is "
                                        f"float32 on the CPU)")
    return True


def check_on_gpu(checks: Checks, me: Rank) -> bool:
    """ShardedAdam run again as on a GPU machine (ringside.effects.on_rank_gpu): parameters on this rank's
    stand-in GPU, built and stepped once; its moments and the parameters must stay on that device."""
    def run(device: torch.device):
        generator = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(7, generator=generator).to(device)),
                  nn.Parameter(torch.randn(3, generator=generator).to(device))]
        optimizer = lab.ShardedAdam(params)
        moments = [getattr(optimizer, name, None) for name in ("exp_avg", "exp_avg_sq")]
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        return [m for m in moments if isinstance(m, torch.Tensor)] + params

    problem, note = on_rank_gpu("ShardedAdam", run, lab.ShardedAdam, lab.adam_update,
                                what="a moment (or a parameter after step)")
    if note:
        print0(note)
    return checks.expect(problem is None, problem or "")


def layouts(world_size: int) -> list[tuple[str, list[tuple[int, ...]], set, set, torch.dtype]]:
    """(what it is, shapes, indices frozen, indices that get no gradient, dtype), smallest first."""
    return sorted([
        ("one parameter of 1 element", [(1,)], set(), set(), torch.float32),
        (f"parameters of {world_size} + {2 * world_size} elements (no padding)", [(world_size,), (2, world_size)],
         set(), set(), torch.float32),
        ("parameters of 12, 5 and 2 elements, the 5 frozen, the 2 never given a gradient", [(3, 4), (5,), (2,)],
         {1}, {2}, torch.float32),
        ("float64 parameters of 7 and 3 elements", [(7,), (3,)], set(), set(), torch.float64),
    ], key=lambda layout: sum(torch.Size(s).numel() for s in layout[1]))


def layout_mistake(me: Rank, what: str, shapes, frozen: set, unused: set, dtype) -> str | None:
    """Three steps of your ShardedAdam on these parameters against torch.optim.Adam on the gradients
    averaged over the ranks (a trainable parameter without a gradient: a zero gradient, as the
    docstring says)."""
    generator = torch.Generator().manual_seed(lab.SEED + 13)
    start = [torch.randn(s, generator=generator, dtype=dtype) for s in shapes]
    mine = [nn.Parameter(t.clone().to(me.device), requires_grad=i not in frozen) for i, t in enumerate(start)]
    theirs = [nn.Parameter(t.clone(), requires_grad=i not in frozen) for i, t in enumerate(start)]
    optimizer = lab.ShardedAdam(mine)
    adam = torch.optim.Adam([p for p in theirs if p.requires_grad], lr=lab.LR, betas=lab.BETAS, eps=lab.EPS)
    for step in range(1, 4):
        everyones = [[torch.randn(s, generator=generator, dtype=dtype) for s in shapes] for _ in range(me.world_size)]
        for i, (p, q) in enumerate(zip(mine, theirs)):
            if i in frozen:
                continue
            p.grad = None if i in unused else everyones[me.rank][i].clone().to(me.device)
            q.grad = torch.zeros_like(q) if i in unused else sum(g[i] for g in everyones) / me.world_size
        optimizer.step()
        adam.step()
        for i, (p, q) in enumerate(zip(mine, theirs)):
            # Tolerance: the same Adam in another order of float additions: about 1e-7 relative on
            # values of about 1; a wrong step moves a weight by about LR = 1e-2.
            gap = max_diff(p.detach().cpu(), q.detach())
            if gap > 1e-5:
                which = ("a frozen parameter moved: leave parameters that do not require gradients alone" if i in frozen
                         else "the parameter that got no gradient: it counts as a zero gradient" if i in unused
                         else f"parameter {i} {tuple(shapes[i])}")
                return (f"with {what} at {ranks_count(me.world_size)}: after step {step}, ShardedAdam differs from "
                        f"torch.optim.Adam on the averaged gradients by {gap:.2e} ({which})")
        optimizer.zero_grad()
        adam.zero_grad()
    return None


def check_layouts(checks: Checks, me: Rank) -> bool:
    """Your ShardedAdam on parameter lists the lab's model does not have, the smallest first."""
    for layout in layouts(me.world_size):
        try:
            wrong = layout_mistake(me, *layout)
        except WrongShardSize as error:
            wrong = str(error)
        if not everyone(wrong is None):
            return checks.expect(False, wrong) if wrong else False
    return checks.expect(True, "")


def train_both(checks: Checks, me: Rank) -> bool:
    """DDP + torch.optim.Adam and your ShardedAdam, step by step on the same batches."""
    reference = DDP(lab.make_model().to(me.device), device_ids=[me.device.index] if me.device.type == "cuda" else None)
    adam = torch.optim.Adam(reference.parameters(), lr=lab.LR, betas=lab.BETAS, eps=lab.EPS)
    model = lab.make_model().to(me.device)
    optimizer = lab.ShardedAdam(model.parameters())
    params = list(model.parameters())
    for step, (x, y) in enumerate(lab.batches(me.rank, me.world_size, me.device), start=1):
        adam.zero_grad()
        F.cross_entropy(reference(x), y).backward()  # DDP averages the gradients
        adam.step()
        if step == 1:  # Adam's state exists now
            adam_bytes = sum(s[k].numel() * s[k].element_size() for s in adam.state.values()
                             for k in ("exp_avg", "exp_avg_sq"))
            wrong = moments_shape_mistake(optimizer, optimizer.stop - optimizer.start)
            if not everyone(checks.expect(wrong is None, wrong or "")):
                return
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()      # this rank's gradient only: your step averages
        before = flat_params(model)
        with Recorder(namespaces=lab_namespaces(lab)) as recorder, \
                recording_adam_updates(optimizer.stop - optimizer.start) as updates:
            try:
                optimizer.step()
            except WrongShardSize as error:
                checks.fail(f"step {step}: {error}")
                return
            except ZeroDivisionError as error:  # in Python floats, 1 - beta**0 = 0 divides by zero
                checks.fail(f"step {step} raised ZeroDivisionError ({error}): Adam's bias correction "
                            f"1 - beta**t is 0 for t = 0 - count the step before the update (the first step has t = 1)")
                return
        # (name, bytes of the whole tensor it works on) for each collective, the check's own *_object calls left out
        calls = [(c.op, c.whole_bytes) for c in recorder.calls if not c.op.endswith("_object")]
        if step == 1:
            check_traffic(checks, me, calls, optimizer.numel)
            # After the first step: an optimizer that builds its state lazily (an inner torch.optim.Adam) has it now.
            if not everyone(check_state(checks, me, optimizer, model, adam_bytes)):
                return
        mine = flat_params(model)
        if torch.isnan(mine).any():
            checks.fail(f"the weights are NaN after step {step}: Adam's bias correction 1 - beta**t is 0 for "
                        f"t = 0 - count the step before the update (the first step has t = 1)")
            return
        wrong = step_mistake(me, optimizer, model, reference, step, before, calls, updates)
        if not everyone(wrong is None):
            if wrong:
                checks.fail(wrong)
            return
        copies = all_gather_tensor(mine.to(me.device))
        if any(max_diff(mine, c.cpu()) > 0 for c in copies):
            checks.fail(f"after step {step} the ranks' weights differ: every rank must end the step with every "
                        f"rank's updated shard - the all-gather is missing or writes to the wrong places")
            return
        # Tolerance: the gradients are averaged in another order (float32, about 1e-7 relative) and
        # Adam divides by sqrt(v): each step moves a weight by at most about LR = 1e-2, and a rounding
        # difference changes that by far less than 1e-6 per step (measured: 0 at 2 ranks, 3e-8 at 4
        # after 6 steps). A real mistake moves weights by about LR.
        gap = max_diff(mine, flat_params(reference))
        if gap > 1e-5:
            later = (f"; it matched until step {step - 1}: does the bias correction use the right step "
                     f"count t = 1, 2, 3, ... (ShardedAdam.steps is {optimizer.steps})?" if step > 1
                     else ": check the slice [start:stop] you update and the shard you average")
            checks.fail(f"after step {step} the weights differ from DDP + torch.optim.Adam by {gap:.2e} "
                        f"(tolerance 1e-5){later}")
            return
    counted = checks.expect(optimizer.steps == lab.STEPS, f"ShardedAdam.steps is {optimizer.steps} after {lab.STEPS} steps: "
                  f"count every step (Adam's bias correction needs it)")
    print0(f"{lab.STEPS} steps: weights equal to DDP + torch.optim.Adam to within 1e-5 on {ranks_count(me.world_size)}")
    return everyone(counted)


class WrongShardSize(Exception):
    """adam_update was handed tensors that are not one shard, on some rank: every rank raises it."""


@contextmanager
def recording_adam_updates(shard: int):
    """Inside the block, every call of adam_update through its global name (as ShardedAdam.step
    calls it) is recorded as {"param", "grad", "t"} (param as it was before the update), then run.
    When its tensors are not `shard` elements long on some rank, every rank raises WrongShardSize
    instead: a crash on one rank alone would leave the others waiting in the all-gather."""
    namespace = lab.adam_update.__globals__  # the lab's own globals, where ShardedAdam.step looks it up
    calls, original = [], namespace["adam_update"]
    signature = inspect.signature(original)

    def recorded(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, shard_size_mistake(bound, shard))  # not a counted collective
        wrong = next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)
        if wrong:
            raise WrongShardSize(wrong)
        calls.append({"param": bound["param"].detach().cpu().clone(), "grad": bound["grad"].detach().cpu().clone(),
                      "t": bound["t"]})
        return original(*args, **kwargs)

    namespace["adam_update"] = recorded
    try:
        yield calls
    finally:
        namespace["adam_update"] = original


def shard_size_mistake(arguments: dict, shard: int) -> str | None:
    """What is wrong with the sizes of the tensors handed to adam_update, or None when all are one shard."""
    tensors = {name: arguments.get(name) for name in ("param", "grad", "exp_avg", "exp_avg_sq")}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return None  # adam_update itself will say what it cannot use
    sizes = {name: t.numel() for name, t in tensors.items()}
    if set(sizes.values()) == {shard}:
        return None
    padded = shard * dist.get_world_size()
    if sizes["param"] != shard:
        whole = "all the flattened parameters" if sizes["param"] == padded else f"{sizes['param']} parameters"
        return (f"step gave adam_update {whole}, but this rank's shard has {shard}: update only the shard, "
                f"[start:stop] of the flattened parameters (the gradient and the moments are one shard)")
    if sizes["grad"] != shard:
        fix = ("reduce-scatter it with average_grad_shard" if sizes["grad"] == padded
               else "average_grad_shard already returns this rank's shard - do not slice it again")
        return f"step gave adam_update a gradient of {sizes['grad']} elements, the shard has {shard}: {fix}"
    return (f"adam_update got moments of {sizes['exp_avg']} and {sizes['exp_avg_sq']} elements for a shard of "
            f"{shard}: create them with stop - start elements")


def padded_shard(flat: torch.Tensor, numel_padded: int, start: int, stop: int) -> torch.Tensor:
    """[start:stop] of `flat` padded with zeros to numel_padded elements (built here, not with your flatten_padded)."""
    return torch.cat([flat, flat.new_zeros(numel_padded - flat.numel())])[start:stop]


def step_mistake(me: Rank, optimizer: lab.ShardedAdam, model: nn.Module, reference: nn.Module, step: int,
                 before: torch.Tensor, calls, updates) -> str | None:
    """What ShardedAdam.step did wrong, from what it handed adam_update and the collectives, or None.
    The weights matched DDP's until this step, so DDP's averaged gradient is the one to expect."""
    padded = -(-optimizer.numel // me.world_size) * me.world_size
    start, stop = optimizer.start, optimizer.stop
    if len(updates) == 1:  # the step as the TODO asks (one adam_update on the shard); else nothing to compare
        wrong = update_arguments_mistake(me, updates[0], step, padded_shard(before, padded, start, stop),
                                         padded_shard(flat_grads(reference), padded, start, stop),
                                         padded_shard(flat_grads(model), padded, start, stop), start, stop)
        if wrong:
            return wrong
    if max_diff(flat_params(model), before) == 0:
        if not any(name.startswith("all_gather") for name, _ in calls):
            return (f"step {step} left the weights unchanged and made no all-gather: flatten_padded returns a copy, "
                    f"so adam_update moved only that copy - gather_params(param_shard, params) after adam_update")
        return (f"step {step} left the weights unchanged: gather_params must send the shard AFTER adam_update "
                f"moved it (flatten_padded returns a copy: the parameters change only through the all-gather)")
    return None


def update_arguments_mistake(me: Rank, update: dict, step: int, param: torch.Tensor, average: torch.Tensor,
                             local: torch.Tensor, start: int, stop: int) -> str | None:
    """What is wrong with the parameter shard, the gradient shard and the t that step handed to adam_update."""
    if update["t"] != step:
        after = " - count the step before the update" if update["t"] == step - 1 else ""
        return (f"step {step} called adam_update with t = {update['t']}: does the bias correction use the right "
                f"step count? t is this step's number, 1, 2, 3, ...{after}")
    mine = update["param"]
    if mine.shape != param.shape or not torch.equal(mine, param):
        return (f"after step {step} the weights differ from DDP + torch.optim.Adam: step gave adam_update "
                f"{mine.numel()} parameters that are not this rank's shard [{start}:{stop}] of the flattened "
                f"parameters - update the same slice as the gradient shard")
    grad = update["grad"]
    # Tolerance: the same average summed in another order, float32: about 1e-7 relative.
    if max_diff(grad, average) <= 1e-5 * (1 + average.abs().max().item()):
        return None
    if torch.equal(grad, local) and me.world_size > 1:
        return (f"step {step} gave adam_update this rank's own gradient, not the average over the ranks: "
                f"reduce-scatter it with average_grad_shard(flatten_padded(grads)) and pass that shard")
    ratio = float(grad @ average / (average @ average))
    if abs(ratio - 1 / me.world_size) < 0.01:
        return (f"the gradient shard step gave adam_update is 1/{me.world_size} of the average - averaged twice: "
                f"average_grad_shard already averages, do not divide by world_size again in step")
    if abs(ratio - me.world_size) < 0.01:
        return (f"the gradient shard step gave adam_update is {me.world_size}x the average: it is the sum - "
                f"pass what average_grad_shard returns, not multiplied by world_size")
    return (f"step {step} gave adam_update a gradient that is not this rank's shard [{start}:{stop}] of the "
            f"averaged gradient: average_grad_shard of the whole padded gradient returns exactly that shard")


def check_traffic(checks: Checks, me: Rank, calls, numel: int) -> None:
    """One step's collectives should send, per rank, what one all-reduce of the gradients sends."""
    padded = -(-numel // me.world_size) * me.world_size * 4
    sent, all_reduce = ring_bytes_sent(calls, me.world_size), ring_bytes_sent([("all_reduce", padded)], me.world_size)
    print0(f"one step's collectives: {[name for name, _ in calls]}, {sent:.0f} bytes sent per rank on a ring; "
           f"one all-reduce of the padded gradient: {all_reduce:.0f}")
    # Exact: byte counts, no rounding.
    checks.expect(sent <= all_reduce, f"one step hands the collectives {sent:.0f} bytes per rank on a ring, more than "
                                      f"one all-reduce of the gradient ({all_reduce:.0f}): reduce-scatter the "
                                      f"gradient and all-gather the parameters, nothing more "
                                      f"(calls: {[name for name, _ in calls]})")


def main(me: Rank, checks: Checks) -> None:
    for check in (check_flatten, check_shard_range, check_average, check_adam, check_gather,
                  check_moments_follow_params):
        if not everyone(check(checks, me)):
            return
    if train_both(checks, me) and check_layouts(checks, me):  # right on the CPU: now as on a GPU machine
        check_on_gpu(checks, me)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 13 (sharding)")
