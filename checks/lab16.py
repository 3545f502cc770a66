"""The check of lab 16 (fsdp): it runs the code of labs/16_fsdp.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).

The verdict comes from what the code does, never from how it is written:
- outputs: shard_of over world sizes 1-5 and sizes that divide and do not; all_gather_flat in float32,
  bf16 and fp16; average_shard from bf16 and fp32 gradients; the wrapper's weights after every step of
  SGD against one process on the global batch (bit for bit at 1 rank), its gradients after the first,
  and full_parameters() under fp32 and bf16 compute (float32, the master weights' values);
- state after: which gathered units are still alive after the forward and after the backward, which
  layer still holds one, the inputs the pieces must not change;
- communication (ringside.calls): the dtype and bytes of every all-gather, reduce-scatter and
  all-reduce, so a gather in the wrong dtype, a unit gathered twice in one backward or a Parameter
  all-reduced twice shows as bytes.
The diagnosis runs only after a FAIL: it tries the learner's pack and unpack on views of a gathered
unit at offset 0 and at another offset, and names a mistake only when what it predicts is what was seen.
"""

from __future__ import annotations

import time
import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder, lab_namespaces
from ringside.effects import Contract, Inputs, beyond_stand_in, on_rank_gpu, storage_excess, watch
from ringside.lab import ranks_count

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()

BF16 = torch.bfloat16


# --- What the collectives did (recorded by ringside.calls) ----------------------------------------


GATHER, AVERAGE = Contract("all_gather_flat"), Contract("average_shard")  # both change nothing they are given


def recording() -> Recorder:
    """Every collective the lab's code makes, recorded (ringside.calls), whatever name it calls it by."""
    return Recorder(namespaces=lab_namespaces(lab))


def of(calls, family: str) -> list:
    return [c for c in calls if c.family == family]


def outputs_of(call) -> list[torch.Tensor]:
    return [t for t in (ref() for ref in call.outputs) if t is not None]


# Ways of finishing a call after which nothing of the recorder holds its output. A gather waited
# through its future is left out of the count of what is alive: the recorder's stand-in future keeps
# the value it relayed (ringside.calls.Watched), so its output would look held by the learner.
UNHELD = (None, "blocking", "wait", "synchronize", "is_completed")


def alive_outputs(calls) -> list[torch.Tensor]:
    """The outputs of the recorded all-gathers that something still holds. gloo's worker thread may
    hold a finished collective's output a moment longer: wait up to 1 s for it to let go."""
    watched = [c for c in of(calls, "all_gather") if c.get("completed_by") in UNHELD]
    for _ in range(100):
        alive = [t for c in watched for t in outputs_of(c)]
        if not alive:
            return []
        del alive
        time.sleep(0.01)
    return [t for c in watched for t in outputs_of(c)]


def scale_mistake(got: torch.Tensor, want: torch.Tensor, world_size: int, what: str, fix_sum: str) -> str | None:
    """Names a gradient that is N times or 1/N of the average; None when it is neither."""
    if world_size == 1 or not want.abs().sum():
        return None
    ratio = float(got.double().reshape(-1) @ want.double().reshape(-1) / (want.double().reshape(-1) @ want.double().reshape(-1)))
    if abs(ratio - world_size) < 0.01:
        return f"{what} is {world_size}x the average over the ranks: summed but not divided - {fix_sum}"
    if abs(ratio - 1 / world_size) < 0.01:
        return (f"{what} is 1/{world_size} of the average over the ranks: divided twice (ReduceOp.AVG already "
                f"divides by world_size)")
    return None


def shares_storage(value, tensor: torch.Tensor) -> bool:
    """Whether `value` (a tensor, or a tuple/list/dict of them) holds memory of `tensor`'s storage."""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(shares_storage(v, tensor) for v in value)
    return False


# --- The pieces, one at a time, over a space of inputs ---------------------------------------------


def elements(n: int) -> str:
    return f"{n} element{'' if n == 1 else 's'}"


def shard_of_mistake(numel: int, n_ranks: int) -> str | None:
    """What is wrong with shard_of for a vector of `numel` elements at `n_ranks` ranks, or None."""
    flat = torch.arange(1.0, numel + 1.0)
    inputs = Inputs(flat=flat)
    size = -(-numel // n_ranks)
    want = [expected_shard(flat, r, n_ranks) for r in range(n_ranks)]
    got = [lab.shard_of(flat, r, n_ranks) for r in range(n_ranks)]
    if inputs.changed():
        return f"shard_of changed the vector it was given ({elements(numel)}, world_size={n_ranks}): leave it as it is"
    if any(g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for g in got):
        return ("shard_of returned a view of its input: the shard must be a new tensor (.clone()), or the optimizer "
                "steps the model's own memory")
    sizes = sorted({g.numel() for g in got})
    if sizes != [size]:
        if len(sizes) > 1:
            why = "the shards have unequal sizes: pad with zeros first, so every rank gets the same size"
        elif sizes[0] < size:
            why = f"the shards skip elements: round the shard size UP, ceil({numel} / {n_ranks}) = {size}"
        else:
            why = f"the shards are too long: ceil({numel} / {n_ranks}) = {size} elements each"
        return (f"shard_of({elements(numel)}, world_size={n_ranks}) gave shards of {[g.numel() for g in got]} "
                f"elements: {why} (all-gather and reduce-scatter need equal pieces)")
    if all(torch.equal(g, w) for g, w in zip(got, want)):
        return kept_alive(got, numel, n_ranks, size)
    # A known mistake is named only when what it predicts holds on every rank.
    real = [max(0, min(size, numel - r * size)) for r in range(n_ranks)]
    if all(torch.equal(g[:k], w[:k]) for g, w, k in zip(got, want, real)):
        r = next(r for r in range(n_ranks) if got[r][real[r]:].any())
        return (f"the padding of rank {r}'s shard ({elements(numel)}, world_size={n_ranks}) holds "
                f"{got[r][real[r]:].tolist()}, not zeros: the padding is fed to the optimizer (it steps every element "
                f"of the shard) and gathered with the layer - pad with zeros")
    owners = [next((k for k in range(n_ranks) if torch.equal(g, want[k])), None) for g in got]
    if sorted(k for k in owners if k is not None) == list(range(n_ranks)):
        r = next(r for r in range(n_ranks) if owners[r] != r)
        return (f"shard_of({elements(numel)}, world_size={n_ranks}) for rank {r} returned the shard of rank "
                f"{owners[r]}: a shard of the wrong rank - rank r takes the r-th piece, [r * size, (r + 1) * size), "
                f"as the collectives hand it out")
    r = next(r for r in range(n_ranks) if not torch.equal(got[r], want[r]))
    return (f"shard_of({elements(numel)}, world_size={n_ranks}) for rank {r} returned {got[r].tolist()}, expected "
            f"{want[r].tolist()}")


def kept_alive(got: list[torch.Tensor], numel: int, n_ranks: int, size: int) -> str | None:
    """Memory, an effect: a shard must hold only its own elements. A view into a larger temporary (the
    padded vector) keeps that whole temporary alive, so nothing is sharded. None if every shard is its own."""
    for r, g in enumerate(got):
        if (excess := storage_excess(g)) is not None:
            held, own = excess
            whole = held == size * n_ranks * g.element_size()
            return (f"shard_of({elements(numel)}, world_size={n_ranks}) for rank {r} returned {elements(g.numel())} "
                    f"whose storage holds {held} bytes ({held // g.element_size()} elements), where the shard needs "
                    f"{own}: the shard keeps " + ("the whole padded unit alive" if whole else "a larger tensor alive")
                    + " (a view of a temporary), so memory is not sharded - return a new tensor of its own "
                      "(.clone() the piece)")
    return None


def check_shard_of(checks: Checks, me: Rank) -> bool:
    """shard_of is pure: every rank tries it at world sizes 1 to 5, for sizes that divide and do not,
    the smallest failing case first."""
    cases = sorted({(numel, n) for n in range(1, 6) for numel in (1, n - 1, n, n + 1, 3 * n, 13, 37) if numel >= 1},
                   key=lambda c: (c[0] * c[1], c))
    wrong = None
    for numel, n_ranks in cases:
        wrong = shard_of_mistake(numel, n_ranks)
        if wrong:
            break
    return checks.settle(wrong)


def check_all_gather(checks: Checks, me: Rank) -> bool:
    """all_gather_flat for 1 and 3 elements, to float32, bf16 and fp16: every rank's shard in rank order,
    sent in the dtype asked for, the shard left as it was (GATHER)."""
    for n in (1, 3):
        shard = (torch.arange(n, dtype=torch.float32) + 10.0 * me.rank + 0.1).to(me.device)  # 0.1: bf16 rounds it
        want = torch.cat([torch.arange(n, dtype=torch.float32) + 10.0 * r + 0.1 for r in range(me.world_size)])
        for dtype in (torch.float32, BF16, torch.float16):
            seen = watch(GATHER, lab.all_gather_flat, shard, dtype, namespaces=lab_namespaces(lab))
            if not checks.settle(seen.problem or gather_mistake(seen.result, seen.calls, want.to(dtype))):
                return False
    return True


def gather_mistake(full: torch.Tensor, calls, want: torch.Tensor) -> str | None:
    sent = [c.dtype for c in of(calls, "all_gather")]
    if not sent:
        return f"all_gather_flat made no all-gather (calls seen: {[c.op for c in calls] or 'none'}): " \
               f"dist.all_gather_into_tensor"
    if any(d != want.dtype for d in sent):
        return (f"all_gather_flat(shard, {want.dtype}) sent {sent[0]}: cast the shard to the compute dtype BEFORE "
                f"the all-gather - a gather in float32 then a cast sends twice the bytes of bf16")
    if full.dtype != want.dtype or full.numel() != want.numel():
        return (f"all_gather_flat returned {full.numel()} elements of {full.dtype}, expected "
                f"{want.numel()} of {want.dtype} (every rank's shard)")
    if not torch.equal(full.cpu(), want):
        return (f"all_gather_flat returned {full.float().tolist()}, expected every rank's shard in rank "
                f"order: {want.float().tolist()}")
    return None


def check_average(checks: Checks, me: Rank) -> bool:
    """average_shard of bf16 and fp32 gradients, 1 and 13 elements a rank: this rank's shard of the
    average, in float32, reduced in float32, the gradient handed in left as it was (AVERAGE)."""
    torch.manual_seed(lab.SEED)
    for per_rank, dtype in ((13, BF16), (1, torch.float32), (13, torch.float32)):
        everyones = torch.randn(me.world_size, per_rank * me.world_size).to(dtype)  # rank r's gradient is row r
        seen = watch(AVERAGE, lab.average_shard, everyones[me.rank].to(me.device, copy=True), namespaces=lab_namespaces(lab))
        want = everyones.float().mean(dim=0)[me.rank * per_rank:(me.rank + 1) * per_rank]
        shard = seen.result.cpu() if isinstance(seen.result, torch.Tensor) else seen.result
        if not checks.settle(seen.problem or average_mistake(shard, seen.calls, want, me.world_size)):
            return False
    return True


def average_mistake(shard: torch.Tensor, calls, want: torch.Tensor, world_size: int) -> str | None:
    sent = [c.dtype for c in of(calls, "reduce_scatter")]
    if of(calls, "all_reduce"):
        return ("average_shard called all_reduce: every rank then receives the whole average and sends 2x the "
                "bytes - reduce-scatter hands each rank its shard")
    if not sent:
        return (f"average_shard made no reduce-scatter (calls seen: {[c.op for c in calls] or 'none'}): "
                f"dist.reduce_scatter_tensor")
    if sent[0] != torch.float32:
        return (f"average_shard reduced in {sent[0]}: the reduce done in bf16/fp16 rounds every partial sum to "
                f"8 (or 11) bits - cast the gradient to float32 BEFORE the reduce-scatter")
    if shard.dtype != torch.float32 or shard.shape != want.shape:
        return (f"average_shard returned {tuple(shard.shape)} of {shard.dtype}, expected this rank's shard, "
                f"{want.numel()} elements of float32")
    # Tolerance: the same N float32 additions in another order: about 1e-7 relative.
    if (shard - want).abs().max() > 1e-6:
        return (scale_mistake(shard, want, world_size, "the gradient shard", "op=dist.ReduceOp.AVG")
                or f"average_shard differs from the average of the ranks' shards by "
                   f"{(shard - want).abs().max():.2e}: rank r must get the r-th piece")
    return None


def check_on_gpu(checks: Checks, me: Rank) -> bool:
    """shard_of, all_gather_flat and average_shard run again as on a GPU machine (ringside.effects.on_rank_gpu),
    their inputs on this rank's stand-in GPU: what they hand the collectives and what they return stay there."""
    def run(device: torch.device):
        flat = (torch.arange(13.0) + me.rank).to(device)
        shard = lab.shard_of(flat, me.rank, me.world_size)
        full_grad = torch.arange(3.0 * me.world_size).to(device, BF16)  # a padded length: it divides
        return [shard, lab.all_gather_flat(shard, BF16), lab.average_shard(full_grad)]

    problem, note = on_rank_gpu("shard_of, all_gather_flat and average_shard", run, lab.all_gather_flat,
                                lab.average_shard, lab.shard_of)
    if note:
        print0(note)
    return checks.settle(problem)


# --- The wrapper ---------------------------------------------------------------------------------


def resolve(module, dotted: str):
    """module.fc2.weight for "fc2.weight" (None where a name is missing)."""
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def unit_plan(model, own: bool = False):
    """[(block name, names, flat fp32 vector of their values, how a message names it)] for the units
    of a fresh model (`own`: the check's model, not the lab's)."""
    names = {m: n for n, m in model.named_modules()}
    return [(names[m], ns, torch.cat([m.get_parameter(n).detach().reshape(-1) for n in ns]).float(),
             f"layer {names[m]} of the check's own model" if own else f"block {names[m]}")
            for m, ns in lab.find_units(model)]


def shards_mistake(me: Rank, wrapped, plan, dtype) -> str | None:
    shards = [unit.shard for unit in wrapped.units]
    mine = {id(p) for p in wrapped.parameters()}
    if not all(id(s) in mine for s in shards):
        return ("model.parameters() does not yield the shards: the optimizer would never step them - keep each "
                "shard an nn.Parameter of the wrapper")
    masters = [p for p in wrapped.parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if masters:
        return (f"with compute_dtype={dtype} the optimizer's parameters are {masters[0].dtype}: the master weights "
                f"left in the compute dtype lose every update smaller than 1/256 of a weight - keep shards and "
                f"replicated parameters in float32, cast only what is gathered")
    for (_, names, flat, layer), shard in zip(plan, shards):
        size = -(-flat.numel() // me.world_size)
        if shard.numel() != size:
            return (f"{layer}: this rank's shard has {shard.numel()} elements, expected "
                    f"ceil({flat.numel()} / {me.world_size}) = {size}")
        if not torch.equal(shard.detach().float(), expected_shard(flat, me.rank, me.world_size)):
            owner = [r for r in range(me.world_size)
                     if torch.equal(shard.detach().float(), expected_shard(flat, r, me.world_size))]
            return (f"{layer}: rank {me.rank} holds the shard of rank {owner[0]} - a shard of the wrong rank"
                    if owner else
                    f"{layer}: this rank's shard is not [{me.rank * size}:{(me.rank + 1) * size}] of the "
                    f"flattened, zero-padded parameters {names}")
    return None


def on(device: torch.device, make):
    """make, whose model is moved to `device`."""
    return lambda: make().to(device)


def global_batch(step: int, world_size: int, device: torch.device):
    """The global batch of this step and every rank's part of it (each rank's batches read once), on `device`."""
    if getattr(lab, "_data", None) is None or len(lab._data) != world_size:
        lab._data = [list(lab.batches(r, world_size)) for r in range(world_size)]
    data = [(x.to(device), y.to(device)) for x, y in (steps[step] for steps in lab._data)]
    return torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]), data


def expected_shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s piece of `flat`, zero-padded to a multiple of world_size (built here, not by shard_of)."""
    size = -(-flat.numel() // world_size)
    return torch.cat([flat, flat.new_zeros(size * world_size - flat.numel())])[rank * size:(rank + 1) * size]


def matrix_at_offset(unit) -> tuple[str, int, torch.Size] | None:
    """(name, offset in the unit, shape) of the unit's first weight matrix that does not start the unit:
    a Linear saves weight.t(), a view of the gathered unit at that offset."""
    offsets = [sum(unit.numels[:i]) for i in range(len(unit.numels))]
    return next(((n, at, shape) for n, at, shape in zip(unit.names, offsets, unit.shapes) if len(shape) == 2 and at),
                None)


def probe_saved_tensors(wrapped) -> str | None:
    """Diagnosis only (after a FAIL, on every rank: unpack gathers). Hands a unit's pack what autograd
    would: a view of a freshly gathered unit at offset 0 and a weight's .t() at another offset; then
    unpacks both with the unit freed. Names what pack or unpack did wrong, or None."""
    unit = next((u for u in wrapped.units if matrix_at_offset(u) is not None), None)
    if unit is None:
        return None
    name, at, shape = matrix_at_offset(unit)
    before = unit.gathered, unit.backward_copy
    try:
        full = lab.all_gather_flat(unit.shard.detach(), unit.dtype)
        views = [full[:at], full[at:at + shape.numel()].view(shape).t()]
        unit.gathered, unit.backward_copy = full, None
        packed = [unit.pack(v) for v in views]
        unit.gathered = None
        keeps = [shares_storage(p, full) for p in packed]
        with recording() as calls:
            got = [unit.unpack(p) for p in packed]
        n_gathers = len(calls.of("all_gather"))
    except Exception:  # noqa: BLE001 - a probe that cannot run names nothing
        return None
    finally:
        unit.gathered, unit.backward_copy = before
    if keeps == [False, True]:
        return (f"pack kept {name}.t(), a view of the gathered unit at offset {at}, whole (not a view at offset 0): "
                f"tensor.data_ptr() is where a view's first element lies, not where the unit's memory starts - "
                f"compare tensor.untyped_storage().data_ptr()")
    if all(keeps):
        return "pack kept the tensors of the gathered unit themselves: return only where each lies (offset, size, stride)"
    want = views[1]
    if not (torch.is_tensor(got[1]) and got[1].shape == want.shape and torch.equal(got[1], want)):
        dropped = full.as_strided(want.size(), want.stride(), 0)
        if torch.is_tensor(got[1]) and got[1].shape == want.shape and torch.equal(got[1], dropped):
            return (f"unpack returned {name}.t() from offset 0 of the unit gathered again, not from its offset {at}: "
                    f"unpack dropped the storage offset - as_strided(size, stride, offset)")
        return f"unpack(pack(t)) did not give back t for {name}.t(), at offset {at} of the gathered unit"
    if n_gathers > 1:
        return (f"unpack gathered the unit {n_gathers} times for two tensors of it: gather it once per backward "
                f"and keep the copy (self.backward_copy) for the others")
    return None


def holder_of(wrapped, alive: list[torch.Tensor]) -> str | None:
    """Diagnosis only: which attribute of a unit still refers to a gathered unit that is alive."""
    for unit in wrapped.units:
        for key, value in vars(unit).items():
            if any(shares_storage(value, t) for t in alive):
                return (f"after the forward the unit's attribute {key!r} still refers to the gathered unit: "
                        f"after_forward must drop every reference to it (self.{key} = None)")
    return None


def step_watched(me: Rank, wrapped, x, y, dtype) -> str | None:
    """One forward and backward with the collectives and the gathered units watched."""
    units = wrapped.units
    block = {id(m): n for n, m in wrapped.module.named_modules()}
    # What each unit's layers hold while it runs (the gathered views), however the unit was gathered:
    # watched by a hook that runs after the unit's own (it was registered later).
    placed = [[] for _ in units]

    def watcher(i, unit):
        def hook(module, args):
            placed[i].extend(weakref.ref(t) for t in (resolve(unit.module, n) for n in unit.names) if torch.is_tensor(t))
        return hook

    handles = [unit.module.register_forward_pre_hook(watcher(i, unit)) for i, unit in enumerate(units)]
    try:
        with recording() as recorder:
            out = wrapped(x)
    finally:
        for handle in handles:
            handle.remove()
    forward = recorder.calls
    held = [(block[id(u.module)], n) for u in units for n in u.names if torch.is_tensor(resolve(u.module, n))]
    if held:
        return (f"a unit never freed: after the forward, block {held[0][0]} still holds its gathered {held[0][1]} - "
                f"set the layers' attributes back to None after it ran (else every rank ends the forward holding "
                f"the whole model)")
    if len(of(forward, "all_gather")) < len(units):
        return (f"the forward made {len(of(forward, 'all_gather'))} all-gathers for {len(units)} units: gather each unit just "
                f"before its block runs")
    alive = alive_outputs(forward)
    kept = sum(any(ref() is not None for ref in refs) for refs in placed)
    if alive or kept:
        held_by = holder_of(wrapped, alive)
        return held_by or (f"after the forward {max(len(alive), kept)} of the {len(units)} gathered units are still "
                           f"alive: "
                           f"autograd saved them for backward, so nothing was freed",
                           "pack a tensor of the gathered unit as its place only, and gather again in unpack "
                           "(saved-tensor hooks)")
    del alive
    loss = F.cross_entropy(out.float(), y)
    try:
        with recording() as recorder:
            loss.backward()
    except RuntimeError as error:
        if "storage" in str(error) or "size" in str(error):
            return (f"backward failed ({str(error).splitlines()[0][:120]}): the gathered unit was freed after the "
                    f"forward but not gathered again for backward")
        raise
    backward = recorder.calls
    again = of(backward, "all_gather")
    if not again:
        return ("the backward made no all-gather: the gather not redone for backward - autograd computed with a "
                "unit that was never gathered again (unpack must all-gather it)")
    left = len(alive_outputs(backward))
    if left:
        return (f"after the backward {left} unit{'s' if left > 1 else ''} gathered for backward "
                f"{'are' if left > 1 else 'is'} still alive: "
                f"free the copy gathered for backward once its gradient is reduce-scattered (GatherUnit.backward)")
    sent = [c.dtype for c in of(backward, "reduce_scatter")]
    if len(sent) < len(units):
        return (f"the backward made {len(sent)} reduce-scatters for {len(units)} units: each unit's gradient is "
                f"reduce-scattered in GatherUnit.backward")
    if any(d != torch.float32 for d in sent):
        return (f"the gradients were reduced in {next(d for d in sent if d != torch.float32)}: the reduce done in "
                f"bf16/fp16 loses the low bits of every gradient - reduce in float32")
    compute = dtype or torch.float32
    for phase, calls in (("forward", forward), ("backward", backward)):
        other = next((c.dtype for c in of(calls, "all_gather") if c.dtype != compute), None)
        if other is not None:
            more = f", {other.itemsize // compute.itemsize}x the bytes of {compute}" if other.itemsize > compute.itemsize else ""
            return (f"with compute_dtype={dtype} the units were gathered in {other} in the {phase}{more}: gather in "
                    f"the compute dtype (all_gather_flat(shard, unit.dtype)), in backward too")
    # Every unit's weights are asked back in backward here (fc2's of every block): gathered again
    # once per unit, the bytes of one gather each. More is a gather per saved tensor.
    once = sum(c.bytes for c in of(forward, "all_gather"))
    if sum(c.bytes for c in again) > once:
        return (f"the backward all-gathered {sum(c.bytes for c in again)} bytes in {len(again)} all-gathers, where "
                f"gathering each of the {len(units)} units once sends {once}",
                "a unit was gathered again for each tensor autograd asked back - once per backward (keep the copy in "
                "self.backward_copy)")
    return None


def synced(me: Rank, wrapped) -> str | None:
    """finish_gradient_sync, its all-reduces measured: the replicated gradients, each Parameter's once."""
    with recording() as recorder:
        try:
            wrapped.finish_gradient_sync()
        except (TypeError, AttributeError, RuntimeError) as error:
            without = [n for n, p in wrapped.names if id(p) not in wrapped.where and p.grad is None]
            if without:
                return (f"finish_gradient_sync raised {type(error).__name__} ({str(error).splitlines()[0][:80]}): "
                        f"{without[0]} has no gradient (grad is None: {'frozen' if not dict(wrapped.names)[without[0]].requires_grad else 'unused'}) "
                        f"- average only the parameters whose .grad is not None")
            raise
    replicated = {id(p): (n, p) for n, p in wrapped.names if id(p) not in wrapped.where and p.grad is not None}
    want = sum(p.grad.numel() * p.grad.element_size() for _, p in replicated.values())
    reduces = recorder.of("all_reduce")
    sent = sum(c.bytes for c in reduces)
    if sent > want:
        twice = [n for n, p in replicated.values()
                 if sum(c.ptr == p.grad.data_ptr() for c in reduces) > 1]
        tied = [n for n in twice if sum(q is dict(wrapped.names)[n] for _, _, q in wrapped.replicated) > 1]
        who = (f"{tied[0]}, held by two layers, was all-reduced twice" if tied else
               f"{twice[0]} was all-reduced twice" if twice else "the replicated gradients were sent more than once")
        return (f"finish_gradient_sync all-reduced {sent} bytes for {want} bytes of replicated gradients: {who} - "
                f"each Parameter once (AVG twice gives the same values, at twice the traffic)")
    return None


def compare_grads(me: Rank, wrapped, plan, reference_grads: dict, local_grads: dict) -> str | None:
    """The shards' and the replicated parameters' gradients against the average the check computed."""
    for (layer, names, _, shown), unit in zip(plan, wrapped.units):
        want = expected_shard(torch.cat([reference_grads[f"{layer}.{n}"].reshape(-1) for n in names]),
                              me.rank, me.world_size)
        got = unit.shard.grad
        if got is None:
            return (f"{shown}: its shard has no gradient after backward: GatherUnit.backward must return the "
                    f"gradient of the shard")
        # Tolerance: the same gradient summed in another order (N ranks' partial sums against one
        # matmul over the global batch), float32: about 1e-7 relative; a mistake is off by far more.
        scale = want.abs().max().item() + 1e-12
        if (got.float() - want).abs().max().item() <= 1e-5 * scale:
            continue
        local = expected_shard(torch.cat([local_grads[f"{layer}.{n}"].reshape(-1) for n in names]),
                               me.rank, me.world_size)
        wrong = scale_mistake(got, want, me.world_size, f"{shown}: the shard gradient", "average (ReduceOp.AVG)")
        if wrong is None and me.world_size > 1 and (got - local).abs().max() <= 1e-5 * scale:
            wrong = f"{shown}: the shard gradient is this rank's own, not the average over the ranks"
        return wrong or (f"{shown}: the shard's gradient differs from the average of the ranks' gradients by "
                         f"{(got - want).abs().max():.2e}",
                         "are the layer's views the first numel elements of the gathered unit, in the order of "
                         "unit.names, and is the shard this rank's?")
    for name, p in wrapped.names:
        if id(p) in wrapped.where or not p.requires_grad:
            continue
        want = reference_grads[name]
        if p.grad is None and not want.any():
            continue  # unused: no gradient on any rank
        if p.grad is None:
            return f"{name} (replicated) has no gradient after finish_gradient_sync"
        if (p.grad - want).abs().max().item() <= 1e-5 * (want.abs().max().item() + 1e-12):
            continue
        if me.world_size > 1 and torch.allclose(p.grad, local_grads[name], rtol=1e-5, atol=1e-7):
            return (f"{name} is replicated (not in a unit) and its gradient was not averaged: finish_gradient_sync "
                    f"must average it over the ranks (all_reduce AVG), as DDP would")
        return (scale_mistake(p.grad, want, me.world_size, f"{name}'s gradient (replicated)", "ReduceOp.AVG")
                or f"{name} (replicated): its gradient differs from the average by {(p.grad - want).abs().max():.2e}")
    return None


def reference_grads(make, data, model_state: dict | None, dtype) -> tuple[dict, list[dict]]:
    """The average over the ranks of each rank's gradient (each computed alone by a model from `make`,
    in `dtype`), and each rank's own; a trainable parameter that got none has a zero gradient."""
    per_rank = []
    for x, y in data:
        model = make()
        if model_state is not None:
            model.load_state_dict(model_state)
        if dtype is not None:
            model = model.to(dtype)
            x = x.to(dtype)
        F.cross_entropy(model(x).float(), y).backward()
        per_rank.append({n: (p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                         for n, p in model.named_parameters() if p.requires_grad})
    average = {n: sum(g[n] for g in per_rank) / len(data) for n in per_rank[0]}
    return average, per_rank


def first_step(checks: Checks, me: Rank, wrapped, plan, x, y, dtype, expected: dict, local: dict) -> bool:
    """The first step's forward, backward and gradient sync, watched, then its gradients compared."""
    if not checks.settle(step_watched(me, wrapped, x, y, dtype), lambda: probe_saved_tensors(wrapped)):
        return False
    if not checks.settle(synced(me, wrapped)):
        return False
    return checks.settle(compare_grads(me, wrapped, plan, expected, local), lambda: probe_saved_tensors(wrapped))


def padding_mistake(me: Rank, wrapped) -> str | None:
    for unit in wrapped.units:  # the padding is no parameter: its gradient must be zero
        padding = unit.shard.numel() * me.world_size - sum(unit.numels)
        mine = max(0, min(unit.shard.numel(), (me.rank + 1) * unit.shard.numel() - sum(unit.numels)))
        if padding and mine and unit.shard.grad is not None and unit.shard.grad[-mine:].any():
            return ("the padding of a shard got a gradient: the padding fed to the optimizer moves - the layers' "
                    "views must cover only [:numel] of the gathered unit")
    return None


def full_parameters_mistake(me: Rank, wrapped, reference, dtype, exact: bool = True) -> str | None:
    """full_parameters(): every parameter by name, whole, float32, and (when `exact`: nothing stepped
    yet) the reference's values bit for bit."""
    full = wrapped.full_parameters()
    missing = [n for n, _ in reference.named_parameters() if n not in full]
    if missing:
        return f"full_parameters() lacks {missing}: every parameter by its name in the model"
    for name, p in reference.named_parameters():
        if tuple(full[name].shape) != tuple(p.shape):
            return (f"full_parameters()[{name!r}] has shape {tuple(full[name].shape)}, expected {tuple(p.shape)}: drop "
                    f"the padding, split by numel, reshape")
        if full[name].dtype != torch.float32:
            return (f"with compute_dtype={dtype} full_parameters()[{name!r}] is {full[name].dtype}: a checkpoint of "
                    f"the compute dtype loses the master weights' low bits - gather in float32 whatever the compute "
                    f"dtype")
    if exact:
        for name, p in reference.named_parameters():
            if not torch.equal(full[name], p.detach()):
                rounded = torch.equal(full[name], p.detach().to(dtype).float())
                why = (f": they were rounded to {dtype} - gather in float32 whatever the compute dtype"
                       if rounded and dtype is not None else "")
                return (f"with compute_dtype={dtype} full_parameters()[{name!r}] differs from the float32 master "
                        f"weights by {(full[name] - p.detach()).abs().max():.2e}{why}")
    return None


def train(checks: Checks, me: Rank) -> bool:
    """STEPS steps of SGD with momentum: your wrapper on each rank's batch against one process on the
    global batch."""
    make = on(me.device, lab.make_model)  # the models and batches on the rank's GPU under nccl
    plan = unit_plan(make())
    wrapped = lab.FullyShardedDP(make())
    if not checks.settle(shards_mistake(me, wrapped, plan, None)):
        return False
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lab.LR, momentum=lab.MOMENTUM)
    opt = torch.optim.SGD(wrapped.parameters(), lr=lab.LR, momentum=lab.MOMENTUM)
    for step in range(lab.STEPS):
        x, y, data = global_batch(step, me.world_size, me.device)
        if step == 0:
            _, local = reference_grads(make, data, reference.state_dict(), None)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        if step == 0:
            expected = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_opt.step()
        opt.zero_grad()
        mine_x, mine_y = data[me.rank]
        if step == 0:
            if not first_step(checks, me, wrapped, plan, mine_x, mine_y, None, expected, local[me.rank]):
                return False
        else:
            F.cross_entropy(wrapped(mine_x).float(), mine_y).backward()
            wrapped.finish_gradient_sync()
        if not checks.settle(padding_mistake(me, wrapped)):
            return False
        opt.step()
        if not checks.settle(full_parameters_mistake(me, wrapped, reference, None, exact=False)):
            return False
        full = wrapped.full_parameters()
        gap = max((full[n].float() - p.detach()).abs().max().item() for n, p in reference.named_parameters())
        # Tolerance: at 1 rank the same float operations run in the same order, so the weights must be
        # equal bit for bit. At N ranks each rank's matmul sums its own rows and the reduce-scatter adds
        # the N partial sums: another order of float32 additions, about 1e-7 relative per step
        # (measured: at most 3e-8 after 4 steps at 2-4 ranks); a real mistake moves a weight by ~LR * grad.
        limit = 0.0 if me.world_size == 1 else 1e-6
        wrong = None
        if gap > limit:
            wrong = (f"after step {step + 1} the weights differ from one process on the global batch by {gap:.2e} "
                     f"(tolerance {limit:g}{': 1 rank does the same float operations' if limit == 0 else ''})")
        if not checks.settle(wrong):
            return False
        if step == 0:
            same = [None] * me.world_size
            dist.all_gather_object(same, {n: t.sum().item() for n, t in full.items()})
            if not checks.settle("full_parameters() differs between the ranks" if any(s != same[0] for s in same)
                          else None):
                return False
    print0(f"{lab.STEPS} steps of SGD with momentum at {ranks_count(me.world_size)}: weights equal to one process on "
           f"the global batch (largest difference {gap:.1e}, tolerance {limit:g})")
    return True


def one_step(checks: Checks, me: Rank, make, data, dtype, own: bool = False) -> bool:
    """One step of FullyShardedDP(make(), dtype) on this rank's part of `data`, against each rank's
    gradient computed alone by a model from `make` in `dtype` (the same bf16 operations as the
    wrapper's), cast to fp32 and averaged: only the fp32 order of N additions differs, so the 1e-5
    tolerance of compare_grads holds. full_parameters() after it: the float32 master weights."""
    make = on(me.device, make)  # the models and batches on the rank's GPU under nccl
    data = [(x.to(me.device), y.to(me.device)) for x, y in data]
    plan = unit_plan(make(), own)
    wrapped = lab.FullyShardedDP(make(), dtype)
    if not checks.settle(shards_mistake(me, wrapped, plan, dtype)):
        return False
    expected, local = reference_grads(make, data, None, dtype)
    x, y = data[me.rank]
    return (first_step(checks, me, wrapped, plan, x, y, dtype, expected, local[me.rank])
            and checks.settle(full_parameters_mistake(me, wrapped, make(), dtype)))


def mixed_precision(checks: Checks, me: Rank) -> bool:
    """One step with compute_dtype=bf16: gathered and computed in bf16, reduced and stepped in fp32."""
    if not one_step(checks, me, lab.make_model, global_batch(0, me.world_size, me.device)[2], BF16):
        return False
    print0("bf16 compute, fp32 shards, reduce-scatter and full_parameters(): gradients equal to the bf16 reference "
           "within 1e-5")
    return True


class Twice(torch.nn.Module):
    """The check's own layer: two weight matrices registered after the bias, and a parameter it never
    uses. Autograd saves both matrices (as .t(), views of the gathered unit at offsets other than 0)
    when the layer's input needs a gradient: the unit is asked back twice in one backward."""

    def __init__(self, n_in: int, n_mid: int, n_out: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(n_mid) * 0.1)
        self.weight = torch.nn.Parameter(torch.randn(n_mid, n_in) / n_in ** 0.5)
        self.weight2 = torch.nn.Parameter(torch.randn(n_out, n_mid) / n_mid ** 0.5)
        self.spare = torch.nn.Parameter(torch.randn(3))  # never used: a zero gradient

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.weight, self.bias)), self.weight2)


def make_corner_model():
    """Units of 58 and 30 elements (padded at 4 ranks, 58 also at 3 and 5), each a layer asked back in
    backward at offsets other than 0, the second one for two matrices."""
    torch.manual_seed(lab.SEED + 16)
    return torch.nn.Sequential(Twice(6, 5, 4), torch.nn.Tanh(), Twice(4, 3, 4))


def corners(checks: Checks, me: Rank, dtype) -> bool:
    """One step of the check's own model (see Twice), whatever model the lab builds: the saved-tensor
    path at offsets other than 0, two saved tensors of one unit, an unused parameter."""
    generator = torch.Generator().manual_seed(lab.SEED + 16)
    data = [(torch.randn(5, 6, generator=generator), torch.randint(0, 4, (5,), generator=generator))
            for _ in range(me.world_size)]
    return one_step(checks, me, make_corner_model, data, dtype, own=True)


def main(me: Rank, checks: Checks) -> None:
    for check in (check_shard_of, check_all_gather, check_average, check_on_gpu):
        if not check(checks, me):
            return
    try:
        if train(checks, me) and corners(checks, me, None) and mixed_precision(checks, me) and corners(checks, me, BF16):
            print0("the check's own model (two matrices a unit, at offsets other than 0, an unused parameter): "
                   "gradients equal to one process's in float32 and bf16")
    except Exception as error:  # the wrapper's saved-tensor hooks run below Python: not on a stand-in GPU
        if not beyond_stand_in("FullyShardedDP's training", error):
            raise


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 16 (fsdp)")
