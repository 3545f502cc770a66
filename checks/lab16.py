"""The check of lab 16 (fsdp): it runs the code of labs/16_fsdp.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringside import Checks, Rank, print0, run_lab
from ringside.lab import ranks_count

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()

GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
REDUCES = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_reduce")
BF16 = torch.bfloat16


# --- Watching the collectives --------------------------------------------------------------------


@contextmanager
def watching():
    """Inside the block, every gather and reduce called through torch.distributed is recorded as a
    SimpleNamespace(name, dtype of what is sent, numel, alive: a weak reference to a gather's output).
    A collective called inside a recorded one is not recorded again."""
    calls, depth = [], [0]
    originals = {name: getattr(dist, name) for name in GATHERS + REDUCES if hasattr(dist, name)}

    def recorded(name, original):
        def call(*args, **kwargs):
            if depth[0] == 0:
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, list)]
                sent = tensors[-1] if tensors else None
                out = tensors[0] if name in GATHERS and len(tensors) > 1 else None
                alive = weakref.ref(out) if out is not None else (
                    [weakref.ref(t) for t in lists[0]] if lists else None)
                calls.append(SimpleNamespace(name=name, dtype=sent.dtype if sent is not None else None,
                                             numel=sent.numel() if sent is not None else 0, alive=alive))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name, original in originals.items():
        setattr(dist, name, recorded(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def gathers(calls):
    return [c for c in calls if c.name in GATHERS]


def reduces(calls):
    return [c for c in calls if c.name in REDUCES and c.name != "all_reduce"]


def still_alive(calls) -> int:
    """How many gathered tensors recorded in `calls` are still alive (held by anything). gloo's worker
    thread may hold a finished collective's output a moment longer: wait up to 1 s for it to let go."""
    for _ in range(100):
        n = 0
        for c in gathers(calls):
            refs = c.alive if isinstance(c.alive, list) else [c.alive]
            n += any(r is not None and r() is not None for r in refs)
        if n == 0:
            return 0
        time.sleep(0.01)
    return n


def everyone(ok: bool) -> bool:
    """True when `ok` holds on every rank: all ranks then go on to the next check together."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def scale_mistake(got: torch.Tensor, want: torch.Tensor, world_size: int, what: str, fix_sum: str) -> str | None:
    """Names a gradient that is N times or 1/N of the average; None when it is neither."""
    if world_size == 1 or not want.abs().sum():
        return None
    ratio = float(got.double() @ want.double() / (want.double() @ want.double()))
    if abs(ratio - world_size) < 0.01:
        return f"{what} is {world_size}x the average over the ranks: summed but not divided - {fix_sum}"
    if abs(ratio - 1 / world_size) < 0.01:
        return (f"{what} is 1/{world_size} of the average over the ranks: divided twice (ReduceOp.AVG already "
                f"divides by world_size)")
    return None


# --- The pieces, one at a time -------------------------------------------------------------------


def check_shard_of(checks: Checks, me: Rank) -> bool:
    """shard_of on every rank's behalf (it is pure): sizes that need padding and one that does not."""
    n_ranks = me.world_size
    for numel in (13, 3 * n_ranks, 1):
        flat = torch.arange(1.0, numel + 1.0)
        size = -(-numel // n_ranks)
        padded = torch.cat([flat, torch.zeros(size * n_ranks - numel)])
        want = [padded[r * size:(r + 1) * size] for r in range(n_ranks)]
        got = [lab.shard_of(flat, r, n_ranks) for r in range(n_ranks)]
        if any(g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for g in got):
            return checks.expect(False, f"shard_of returned a view of its input: the shard must be a new tensor "
                                        f"(.clone()), or the optimizer steps the model's own memory")
        sizes = sorted({g.numel() for g in got})
        if sizes != [size]:
            if len(sizes) > 1:
                why = "the shards have unequal sizes: pad with zeros first, so every rank gets the same size"
            elif sizes[0] < size:
                why = f"the shards skip elements: round the shard size UP, ceil({numel} / {n_ranks}) = {size}"
            else:
                why = f"the shards are too long: ceil({numel} / {n_ranks}) = {size} elements each"
            return checks.expect(False, f"shard_of({numel} elements, world_size={n_ranks}) gave shards of "
                                        f"{[g.numel() for g in got]} elements: {why} (all-gather and "
                                        f"reduce-scatter need equal pieces)")
        for r, (g, w) in enumerate(zip(got, want)):
            if torch.equal(g, w):
                continue
            others = [k for k in range(n_ranks) if torch.equal(g, want[k])]
            if others:
                return checks.expect(False, f"shard_of({numel} elements) for rank {r} returned the shard of rank "
                                            f"{others[0]}: a shard of the wrong rank - rank r takes the r-th "
                                            f"piece, [r * size, (r + 1) * size), as the collectives hand it out")
            real = max(0, min(size, numel - r * size))
            if torch.equal(g[:real], w[:real]):
                return checks.expect(False, f"the padding of rank {r}'s shard holds {g[real:].tolist()}, not zeros: "
                                            f"the padding is fed to the optimizer (it steps every element of the "
                                            f"shard) and gathered with the layer - pad with zeros")
            return checks.expect(False, f"shard_of({numel} elements) for rank {r} returned {g.tolist()}, "
                                        f"expected {w.tolist()}")
    return checks.expect(True, "")


def check_all_gather(checks: Checks, me: Rank) -> bool:
    n = 3
    shard = torch.arange(n, dtype=torch.float32) + 10.0 * me.rank + 0.1  # 0.1: bf16 rounds it
    for dtype in (torch.float32, BF16):
        with watching() as calls:
            full = lab.all_gather_flat(shard, dtype)
        want = torch.cat([torch.arange(n, dtype=torch.float32) + 10.0 * r + 0.1 for r in range(me.world_size)])
        sent = [c.dtype for c in gathers(calls)]
        if not sent:
            return checks.expect(False, f"all_gather_flat made no all-gather (calls seen: "
                                        f"{[c.name for c in calls] or 'none'}): dist.all_gather_into_tensor")
        if any(d != dtype for d in sent):
            return checks.expect(False, f"all_gather_flat(shard, {dtype}) sent {sent[0]}: cast the shard to the "
                                        f"compute dtype BEFORE the all-gather - a gather in float32 then a cast "
                                        f"sends twice the bytes of bf16")
        if full.dtype != dtype or full.numel() != n * me.world_size:
            return checks.expect(False, f"all_gather_flat returned {full.numel()} elements of {full.dtype}, "
                                        f"expected {n * me.world_size} of {dtype} (every rank's shard)")
        if not torch.equal(full, want.to(dtype)):
            return checks.expect(False, f"all_gather_flat returned {full.float().tolist()}, expected every "
                                        f"rank's shard in rank order: {want.to(dtype).float().tolist()}")
    return checks.expect(True, "")


def check_average(checks: Checks, me: Rank) -> bool:
    n = -(-37 // me.world_size) * me.world_size
    torch.manual_seed(lab.SEED)
    everyones = torch.randn(me.world_size, n).to(BF16)  # rank r's gradient is row r, in bf16
    with watching() as calls:
        shard = lab.average_shard(everyones[me.rank].clone())
    size = n // me.world_size
    want = everyones.float().mean(dim=0)[me.rank * size:(me.rank + 1) * size]
    if any(c.name == "all_reduce" for c in calls):
        return checks.expect(False, "average_shard called all_reduce: every rank then receives the whole "
                                    "average and sends 2x the bytes - reduce-scatter hands each rank its shard")
    sent = [c.dtype for c in reduces(calls)]
    if not sent:
        return checks.expect(False, f"average_shard made no reduce-scatter (calls seen: "
                                    f"{[c.name for c in calls] or 'none'}): dist.reduce_scatter_tensor")
    if sent[0] != torch.float32:
        return checks.expect(False, f"average_shard reduced in {sent[0]}: the reduce done in bf16/fp16 rounds "
                                    f"every partial sum to 8 (or 11) bits - cast the gradient to float32 BEFORE "
                                    f"the reduce-scatter")
    if shard.dtype != torch.float32 or shard.shape != want.shape:
        return checks.expect(False, f"average_shard returned {tuple(shard.shape)} of {shard.dtype}, expected "
                                    f"this rank's shard, {size} elements of float32")
    # Tolerance: the same N float32 additions in another order: about 1e-7 relative.
    if (shard - want).abs().max() <= 1e-6:
        return checks.expect(True, "")
    wrong = scale_mistake(shard, want, me.world_size, "the gradient shard", "op=dist.ReduceOp.AVG")
    return checks.expect(False, wrong or f"average_shard differs from the average of the ranks' shards by "
                                         f"{(shard - want).abs().max():.2e}: rank r must get the r-th piece")


# --- The wrapper ---------------------------------------------------------------------------------


def unit_plan(model):
    """[(layer name, names, flat fp32 vector of their values)] for the units of a fresh model."""
    names = {m: n for n, m in model.named_modules()}
    return [(names[m], ns, torch.cat([getattr(m, n).detach().reshape(-1) for n in ns]).float())
            for m, ns in lab.find_units(model)]


def check_shards(checks: Checks, me: Rank, wrapped, plan, dtype) -> bool:
    shards = [unit.shard for unit in wrapped.units]
    mine = {id(p) for p in wrapped.parameters()}
    if not all(id(s) in mine for s in shards):
        return checks.expect(False, "model.parameters() does not yield the shards: the optimizer would never "
                                    "step them - keep each shard an nn.Parameter of the wrapper")
    masters = [p for p in wrapped.parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if masters:
        return checks.expect(False, f"with compute_dtype={dtype} the optimizer's parameters are {masters[0].dtype}: "
                                    f"the master weights left in the compute dtype lose every update smaller than "
                                    f"1/256 of a weight - keep shards and replicated parameters in float32, cast "
                                    f"only what is gathered")
    for (layer, names, flat), shard in zip(plan, shards):
        size = -(-flat.numel() // me.world_size)
        padded = torch.cat([flat, flat.new_zeros(size * me.world_size - flat.numel())])
        want = padded[me.rank * size:(me.rank + 1) * size]
        if shard.numel() != size:
            return checks.expect(False, f"layer {layer}: this rank's shard has {shard.numel()} elements, "
                                        f"expected ceil({flat.numel()} / {me.world_size}) = {size}")
        if not torch.equal(shard.detach().float(), want):
            owner = [r for r in range(me.world_size)
                     if torch.equal(shard.detach().float(), padded[r * size:(r + 1) * size])]
            return checks.expect(False, f"layer {layer}: rank {me.rank} holds the shard of rank {owner[0]} - a "
                                        f"shard of the wrong rank" if owner else
                                        f"layer {layer}: this rank's shard is not [{me.rank * size}:"
                                        f"{(me.rank + 1) * size}] of the flattened, zero-padded parameters "
                                        f"{names}")
    return checks.expect(True, "")


def global_batch(step: int, world_size: int):
    """The global batch of this step and every rank's part of it (each rank's batches read once)."""
    if getattr(lab, "_data", None) is None or len(lab._data) != world_size:
        lab._data = [list(lab.batches(r, world_size)) for r in range(world_size)]
    data = [steps[step] for steps in lab._data]
    return torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]), data


def expected_shard(flat_grad: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = -(-flat_grad.numel() // world_size)
    return torch.cat([flat_grad, flat_grad.new_zeros(size * world_size - flat_grad.numel())])[rank * size:(rank + 1) * size]


def watched_step(checks: Checks, me: Rank, wrapped, x, y, dtype) -> bool:
    """One forward and backward with the collectives and the gathered units watched."""
    units = wrapped.units
    layer = {id(m): n for n, m in wrapped.module.named_modules()}
    with watching() as forward:
        out = wrapped(x)
    held = [(layer[id(u.module)], n) for u in units for n in u.names if torch.is_tensor(getattr(u.module, n, None))]
    if held:
        return checks.expect(False, f"a unit never freed: after the forward, layer {held[0][0]} still holds its "
                                    f"gathered {held[0][1]} - set the layer's attributes back to None after it ran "
                                    f"(else every rank ends the forward holding the whole model)")
    if len(gathers(forward)) < len(units):
        return checks.expect(False, f"the forward made {len(gathers(forward))} all-gathers for {len(units)} units: "
                                    f"gather each unit just before its layer runs")
    if still_alive(forward):
        return checks.expect(False, f"after the forward {still_alive(forward)} of the {len(units)} gathered units "
                                    f"are still alive: autograd saved them for backward, so nothing was freed - "
                                    f"pack a tensor of the gathered unit as its place only, and gather again in "
                                    f"unpack (saved-tensor hooks)")
    loss = F.cross_entropy(out.float(), y)
    try:
        with watching() as backward:
            loss.backward()
    except RuntimeError as error:
        if "storage" in str(error) or "size" in str(error):
            return checks.expect(False, f"backward failed ({str(error).splitlines()[0][:120]}): the gathered unit "
                                        f"was freed after the forward but not gathered again for backward")
        raise
    if not gathers(backward):
        return checks.expect(False, "the backward made no all-gather: the gather not redone for backward - autograd "
                                    "computed with a unit that was never gathered again (unpack must all-gather it)")
    if still_alive(backward):
        return checks.expect(False, f"after the backward {still_alive(backward)} units gathered for backward are "
                                    f"still alive: free the copy gathered for backward once its gradient is "
                                    f"reduce-scattered (GatherUnit.backward)")
    sent = [c.dtype for c in reduces(backward)]
    if len(sent) < len(units):
        return checks.expect(False, f"the backward made {len(sent)} reduce-scatters for {len(units)} units: each "
                                    f"unit's gradient is reduce-scattered in GatherUnit.backward")
    if any(d != torch.float32 for d in sent):
        return checks.expect(False, f"the gradients were reduced in {next(d for d in sent if d != torch.float32)}: "
                                    f"the reduce done in bf16/fp16 loses the low bits of every gradient - "
                                    f"reduce in float32")
    if dtype is not None and any(c.dtype != dtype for c in gathers(forward) + gathers(backward)):
        return checks.expect(False, f"with compute_dtype={dtype} the units were gathered in "
                                    f"{next(c.dtype for c in gathers(forward) if c.dtype != dtype)}: gather in "
                                    f"the compute dtype")
    return checks.expect(True, "")


def compare_grads(checks: Checks, me: Rank, wrapped, plan, reference_grads: dict, local_grads: dict) -> bool:
    """The shards' and the replicated parameters' gradients against the average the check computed."""
    for (layer, names, _), unit in zip(plan, wrapped.units):
        want = expected_shard(torch.cat([reference_grads[f"{layer}.{n}"].reshape(-1) for n in names]),
                              me.rank, me.world_size)
        got = unit.shard.grad
        if got is None:
            return checks.expect(False, f"layer {layer}: its shard has no gradient after backward: GatherUnit.backward "
                                        f"must return the gradient of the shard")
        # Tolerance: the same gradient summed in another order (N ranks' partial sums against one
        # matmul over the global batch), float32: about 1e-7 relative; a mistake is off by far more.
        scale = want.abs().max().item() + 1e-12
        if (got.float() - want).abs().max().item() <= 1e-5 * scale:
            continue
        local = expected_shard(torch.cat([local_grads[f"{layer}.{n}"].reshape(-1) for n in names]),
                               me.rank, me.world_size)
        wrong = scale_mistake(got, want, me.world_size, f"layer {layer}'s shard gradient", "average (ReduceOp.AVG)")
        if wrong is None and me.world_size > 1 and (got - local).abs().max() <= 1e-5 * scale:
            wrong = f"layer {layer}'s shard gradient is this rank's own, not the average over the ranks"
        return checks.expect(False, wrong or f"layer {layer}: the shard's gradient differs from the average of "
                                             f"the ranks' gradients by {(got - want).abs().max():.2e}: are the "
                                             f"layer's views the first numel elements of the gathered unit, in "
                                             f"the order of unit.names, and is the shard this rank's?")
    for name, p in wrapped.names:
        if id(p) in wrapped.where or not p.requires_grad:
            continue
        want = reference_grads[name]
        if p.grad is None:
            return checks.expect(False, f"{name} (replicated) has no gradient after finish_gradient_sync")
        if (p.grad - want).abs().max().item() <= 1e-5 * (want.abs().max().item() + 1e-12):
            continue
        if me.world_size > 1 and torch.allclose(p.grad, local_grads[name], rtol=1e-5, atol=1e-7):
            return checks.expect(False, f"{name} is replicated (not in a unit) and its gradient was not averaged: "
                                        f"finish_gradient_sync must average it over the ranks (all_reduce AVG), "
                                        f"as DDP would")
        wrong = scale_mistake(p.grad, want, me.world_size, f"{name}'s gradient (replicated)", "ReduceOp.AVG")
        return checks.expect(False, wrong or f"{name} (replicated): its gradient differs from the average by "
                                             f"{(p.grad - want).abs().max():.2e}")
    return checks.expect(True, "")


def reference_grads(step: int, world_size: int, model_state: dict, dtype) -> tuple[dict, list[dict]]:
    """The average over the ranks of each rank's gradient (each computed alone, in `dtype`), and each
    rank's own, from the weights in `model_state`."""
    _, _, data = global_batch(step, world_size)
    per_rank = []
    for x, y in data:
        model = lab.make_model()
        model.load_state_dict(model_state)
        if dtype is not None:
            model = model.to(dtype)
            x = x.to(dtype)
        F.cross_entropy(model(x).float(), y).backward()
        per_rank.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    average = {n: sum(g[n] for g in per_rank) / world_size for n in per_rank[0]}
    return average, per_rank


def train(checks: Checks, me: Rank) -> bool:
    """STEPS steps of SGD with momentum: your wrapper on each rank's batch against one process on the
    global batch."""
    fresh = lab.make_model()
    plan = unit_plan(fresh)
    wrapped = lab.FullyShardedDP(lab.make_model())
    if not everyone(check_shards(checks, me, wrapped, plan, None)):
        return False
    reference = lab.make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lab.LR, momentum=lab.MOMENTUM)
    opt = torch.optim.SGD(wrapped.parameters(), lr=lab.LR, momentum=lab.MOMENTUM)
    for step in range(lab.STEPS):
        x, y, data = global_batch(step, me.world_size)
        if step == 0:
            expected, local = reference_grads(step, me.world_size, reference.state_dict(), None)
            local = local[me.rank]
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        if step == 0:
            expected = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_opt.step()
        opt.zero_grad()
        mine_x, mine_y = data[me.rank]
        if step == 0:
            if not everyone(watched_step(checks, me, wrapped, mine_x, mine_y, None)):
                return False
        else:
            F.cross_entropy(wrapped(mine_x).float(), mine_y).backward()
        wrapped.finish_gradient_sync()
        if step == 0 and not everyone(compare_grads(checks, me, wrapped, plan, expected, local)):
            return False
        for unit in wrapped.units:  # the padding is no parameter: its gradient must be zero
            padding = unit.shard.numel() * me.world_size - sum(unit.numels)
            mine = max(0, min(unit.shard.numel(), (me.rank + 1) * unit.shard.numel() - sum(unit.numels)))
            if padding and mine and unit.shard.grad is not None and unit.shard.grad[-mine:].any():
                checks.fail("the padding of a shard got a gradient: the padding fed to the optimizer moves - the "
                            "layer's views must cover only [:numel] of the gathered unit")
                return False
        opt.step()
        full = wrapped.full_parameters()
        missing = [n for n, _ in reference.named_parameters() if n not in full]
        if missing:
            return checks.expect(False, f"full_parameters() lacks {missing}: every parameter by its name in the model")
        for name, p in reference.named_parameters():
            if tuple(full[name].shape) != tuple(p.shape):
                return checks.expect(False, f"full_parameters()[{name!r}] has shape {tuple(full[name].shape)}, "
                                            f"expected {tuple(p.shape)}: drop the padding, split by numel, reshape")
        gap = max((full[n].float() - p.detach()).abs().max().item() for n, p in reference.named_parameters())
        # Tolerance: at 1 rank the same float operations run in the same order, so the weights must be
        # equal bit for bit. At N ranks each rank's matmul sums its own rows and the reduce-scatter adds
        # the N partial sums: another order of float32 additions, about 1e-7 relative per step
        # (measured: at most 3e-8 after 4 steps at 2-4 ranks); a real mistake moves a weight by ~LR * grad.
        limit = 0.0 if me.world_size == 1 else 1e-6
        if gap > limit:
            return checks.expect(False, f"after step {step + 1} the weights differ from one process on the "
                                        f"global batch by {gap:.2e} (tolerance {limit:g}"
                                        f"{': 1 rank does the same float operations' if limit == 0 else ''})")
        if step == 0:
            same = [None] * me.world_size
            dist.all_gather_object(same, {n: t.sum().item() for n, t in full.items()})
            if any(s != same[0] for s in same):
                return checks.expect(False, "full_parameters() differs between the ranks")
    print0(f"{lab.STEPS} steps of SGD with momentum at {ranks_count(me.world_size)}: weights equal to one process on "
           f"the global batch (largest difference {gap:.1e}, tolerance {limit:g})")
    return checks.expect(True, "")


def mixed_precision(checks: Checks, me: Rank) -> bool:
    """One step with compute_dtype=bf16: gathered and computed in bf16, reduced and stepped in fp32."""
    plan = unit_plan(lab.make_model())
    wrapped = lab.FullyShardedDP(lab.make_model(), BF16)
    if not everyone(check_shards(checks, me, wrapped, plan, BF16)):
        return False
    _, _, data = global_batch(0, me.world_size)
    expected, local = reference_grads(0, me.world_size, lab.make_model().state_dict(), BF16)
    x, y = data[me.rank]
    if not everyone(watched_step(checks, me, wrapped, x, y, BF16)):
        return False
    wrapped.finish_gradient_sync()
    # The check computed each rank's bf16 gradient with a bf16 copy of the model (the same bf16
    # operations as the wrapper's), cast it to fp32 and averaged: only the fp32 order of N
    # additions differs, so the 1e-5 tolerance of compare_grads holds.
    if not everyone(compare_grads(checks, me, wrapped, plan, expected, local[me.rank])):
        return False
    print0(f"bf16 compute, fp32 shards and reduce-scatter: gradients equal to the bf16 reference within 1e-5")
    return True


def main(me: Rank, checks: Checks) -> None:
    for check in (check_shard_of, check_all_gather, check_average):
        if not everyone(check(checks, me)):
            return
    if train(checks, me):
        mixed_precision(checks, me)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 16 (fsdp)")
