"""Effects that every lab function has, observed one way for every check (docs: CHECKS.md, "six effects").

A check judges what a learner's function did, never how it was written. Some of what it did is not
about one lab at all: whether it changed an input the contract leaves alone, whether it left a request
in flight, whether what it returned keeps more memory alive than its own elements. This module
observes those, so that each check keeps only what is specific to its lab.

    from ringside.effects import Inputs, changed_in_flight, never_waited, storage_excess

    inputs = Inputs(flat=flat, shard=shard)     # copies taken now
    lab.fn(flat, shard)
    inputs.changed()                            # ["flat"]: the names whose tensors differ now

    never_waited(recorder.calls)                # the recorded requests the learner's code never completed
    changed_in_flight(recorder.calls)           # the requests whose tensors it changed before they completed
    storage_excess(shard)                       # (held, own) bytes when its storage is larger than itself

    with rank_gpu(lab.fn) as (gpu, recorder):   # the device effect: tensors on this rank's stand-in GPU
        result, problem = device_problem("fn", lab.fn, torch.ones(4, device=gpu.device))
        problem = problem or misplaced_result("fn", result, gpu.device)   # one line naming the tensor, or None

A lab function's contract, declared once, is checked on every call the check makes (`watch`):

    AVERAGE = Contract("average_grad_shard", like="flat_grad")   # changes nothing; its result: flat_grad's dtype, device
    seen = watch(AVERAGE, lab.average_grad_shard, flat, namespaces=lab_namespaces(lab))
    seen.result, seen.calls, seen.problem     # problem: the first broken promise in one line, or None

    ignored(run, arguments, {"lr": 0.05})       # the arguments whose other value leaves the outcome as it was
    narrowed(got, want)                         # the dtype `want` went through when `got` is `want` rounded
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .standin import _ACTIVE, _BOX, DeviceMismatch, StandInDeviceError, StandInGPU, origin


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in `value` (a tensor, or lists, tuples and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Inputs:
    """Copies of a call's tensor arguments, taken when made; `changed()` names those that differ now
    (in values, shape, dtype or device). NaN equals NaN: an input that held NaN and still does is unchanged."""

    def __init__(self, **arguments):
        self.arguments = arguments
        self.copies = {name: [t.detach().clone() for t in _tensors(value)] for name, value in arguments.items()}

    def changed(self, allowed: Iterable[str] = ()) -> list[str]:
        """The names (in the order given) whose tensors differ from their copies, except `allowed`
        (the arguments the contract lets the function change in place)."""
        allowed = set(allowed)
        found = []
        for name, value in self.arguments.items():
            now, before = _tensors(value), self.copies[name]
            if name in allowed:
                continue
            if len(now) != len(before) or any(not _same(a, b) for a, b in zip(now, before)):
                found.append(name)
        return found


    def how(self, name: str) -> str:
        """In a few words, how `name`'s tensor changed: "divided by 4", "zeroed", "overwritten"."""
        now, before = _tensors(self.arguments[name]), self.copies[name]
        pairs = [(a.detach(), b) for a, b in zip(now, before) if not _same(a, b)]
        if not pairs or any(a.shape != b.shape or not a.is_floating_point() for a, b in pairs):
            return "replaced or resized" if pairs else "unchanged"
        a, b = torch.cat([a.reshape(-1) for a, _ in pairs]).double(), torch.cat([b.reshape(-1) for _, b in pairs]).double()
        if not a.any():
            return "zeroed"
        ratio = float(a @ b / (b @ b)) if b.any() else 0.0
        if ratio and torch.allclose(a, b * ratio, rtol=1e-5, atol=1e-7):
            return f"divided by {1 / ratio:.4g}" if abs(ratio) < 1 else f"multiplied by {ratio:.4g}"
        return "overwritten with other values"


def _same(now: torch.Tensor, before: torch.Tensor) -> bool:
    if now.shape != before.shape or now.dtype != before.dtype or now.device != before.device:
        return False
    return bool(torch.equal(now.detach(), before)) or (
        now.is_floating_point() and bool(torch.equal(torch.nan_to_num(now.detach(), nan=0.0),
                                                     torch.nan_to_num(before, nan=0.0)))
        and bool(torch.equal(now.detach().isnan(), before.isnan())))


def never_waited(calls: Iterable) -> list:
    """The calls (ringside.calls records) that the learner's code never saw complete, however it could
    have waited (Work.wait, a future, a callback): a receive not necessarily arrived, a send whose buffer
    the caller may still change. Blocking calls complete at their return, so only requests show."""
    return [call for call in calls if not call["completed"] and not call.get("refused")]


def changed_in_flight(calls: Iterable) -> list:
    """The calls (ringside.calls records) whose tensors the learner's code changed in place after posting
    them and before they completed: what was sent, or what arrived, is then whatever the race left."""
    return [call for call in calls if call.get("changed_in_flight")]


def unwaited_diagnosis(name: str, calls: Iterable) -> str | None:
    """One sentence naming the requests `name` returned without waiting for, or None if there are none."""
    left = never_waited(calls)
    if not left:
        return None
    kinds = sorted({call["kind"] for call in left})
    receives = sorted({call["peer"] for call in left if "recv" in call["kind"]}, key=str)
    writes = any(not call["p2p"] for call in left)  # a collective's result, like a receive, arrives later
    return (f"{name} returned with {len(left)} request(s) never waited for ({' and '.join(kinds)}"
            + (f" from rank(s) {receives}" if receives else "") + "): "
            + ("a receive has not necessarily arrived when the function returns" if receives else
               "its result has not necessarily arrived when it is read" if writes else
               "the caller may change the tensor while it is still being sent")
            + " - wait on every request before returning")


def storage_excess(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(bytes its storage holds, bytes its own elements need) when the first is larger - a view into a
    larger tensor keeps all of it alive - else None."""
    held, own = tensor.untyped_storage().nbytes(), tensor.numel() * tensor.element_size()
    return (held, own) if held > own else None


def narrowed(got: torch.Tensor, want: torch.Tensor) -> torch.dtype | None:
    """The narrower dtype that `want` passed through when `got` equals `want` rounded to it (float64
    values sent as float32, int64 values past 2**24 as float32), else None: a dtype not kept."""
    if got.shape != want.shape or torch.equal(got, want):
        return None
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        if dtype != want.dtype and torch.equal(got, want.to(dtype).to(want.dtype)):
            return dtype
    return None


@dataclass(frozen=True)
class Contract:
    """What a lab function promises besides its values, declared once per function and checked by
    `watch` on every call: `changes`, the arguments it may change in place (every other tensor argument
    must be as it was); `like`, the argument whose dtype and device its result takes ("" : no rule);
    `returns`, whether its result is ready when it returns (every request completed: "never waited for"
    otherwise; False for a function that hands its requests to the caller)."""
    name: str
    changes: tuple[str, ...] = ()
    like: str = ""
    returns: bool = True
    honours: dict = field(default_factory=dict)  # argument -> another value that must make a difference


@dataclass
class Seen:
    """What one watched call did: its result, its recorded calls, and the first promise it broke (one
    line, or None). `problems` holds them all, the requests first (a result read before its request
    completed is named as such, not by the wrong value it leaves)."""
    result: object
    calls: list
    problems: list[str]
    inputs: Inputs

    @property
    def problem(self) -> str | None:
        return self.problems[0] if self.problems else None


def watch(contract: Contract, fn: Callable, *args, namespaces=(), drain: bool = True, snapshot: bool = False,
          **kwargs) -> Seen:
    """fn(*args, **kwargs) with its communication recorded (ringside.calls) and its contract checked:
    requests never waited for, arguments changed that it may not change, a
    result in another dtype or on another device than `like`. (A request's tensor written while in flight
    is not judged here: gloo's ReduceOp.AVG divides in place as the request completes, which the version
    counters cannot tell from a write by the learner's code.) With `drain`, what it left in flight is
    waited for afterwards by the engine (the record still says the learner's code never waited), so
    that the ranks stay in step. `snapshot`: each call keeps a copy of what it was handed (Recorder's)."""
    from ringside.calls import Recorder
    bound = inspect.signature(fn).bind(*args, **kwargs)
    inputs = Inputs(**bound.arguments)
    with Recorder(namespaces=namespaces, snapshot=snapshot) as recorder:
        result = fn(*args, **kwargs)
    if drain:
        for call in never_waited(recorder.calls):
            if call.get("work") is not None:
                call["work"].wait()
    problems = []
    if contract.returns:
        problems += [text for text in [unwaited_diagnosis(contract.name, recorder.calls)] if text]
    for name in inputs.changed(allowed=contract.changes):
        problems.append(f"{contract.name} changed its argument `{name}` in place ({inputs.how(name)}): the caller's "
                        f"tensor must stay as it was - compute into a tensor of your own")
    like = bound.arguments.get(contract.like) if contract.like else None
    if isinstance(like, (list, tuple)) and like:
        like = like[0]
    out = _tensors(result)
    if isinstance(like, torch.Tensor) and out:
        wrong = [t for t in out if t.dtype != like.dtype or t.device != like.device]
        if wrong:
            problems.append(f"{contract.name} returned a {str(wrong[0].dtype)[6:]} tensor on {wrong[0].device} for "
                            f"a `{contract.like}` of {str(like.dtype)[6:]} on {like.device}: its result takes "
                            f"the dtype and device of `{contract.like}`")
    return Seen(result, recorder.calls, problems, inputs)


def ignored(run: Callable[[dict], object], arguments: dict, others: dict) -> list[str]:
    """The names in `others` whose other value leaves run(arguments)'s outcome exactly as it was: an
    argument the function does not honour (it reads a constant, or the group's size, instead). `run`
    gets fresh copies of the tensors each time (the function may change them in place)."""
    def fresh(values: dict) -> dict:
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else
                [t.detach().clone() for t in v] if isinstance(v, list) else v for k, v in values.items()}

    def same(a, b) -> bool:
        a, b = _tensors(a), _tensors(b)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))

    base = run(fresh(arguments))
    return [name for name, value in others.items() if same(run(fresh({**arguments, name: value})), base)]


# --- device: the function run again as on a GPU machine -------------------------------------------

@contextmanager
def rank_gpu(*functions):
    """Inside, this machine is a GPU machine as `make lab` would find it (ringside.standin): the node
    has LOCAL_WORLD_SIZE stand-in GPUs, this rank's is cuda:LOCAL_RANK, pick_backend() answers
    ("nccl", "cuda"), and every collective and send/recv is recorded and refused, as NCCL refuses it,
    when handed a tensor that is not on this rank's GPU. `functions`: the learner's, whose modules'
    own names for torch.cuda and torch.distributed functions are reached too. Yields (gpu, recorder).

        with rank_gpu(lab.ring_all_reduce) as (gpu, recorder):
            x = torch.arange(8.0, device=gpu.device)
            problem = device_problem("ring_all_reduce", lab.ring_all_reduce, x)
    """
    from .calls import Recorder, lab_namespaces

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    count = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1)
    spaces = lab_namespaces(*functions)
    forced = os.environ.pop("RINGSIDE_BACKEND", None)  # a GPU machine's own choice, not a forced gloo
    joined = dist.init_process_group  # the group exists: joining it again (setup() in lab 01) is noted only
    gpu_joins = []

    def init_process_group(*args, **kwargs):
        gpu_joins.append((args, kwargs))

    named = [(space, key) for space in [vars(dist)] + spaces for key, value in space.items() if value is joined]
    try:
        for space, key in named:
            space[key] = init_process_group
        with StandInGPU(devices=count, current=local_rank, namespaces=spaces) as gpu, \
                Recorder(namespaces=spaces) as recorder:
            gpu.joins = gpu_joins
            yield gpu, recorder
    finally:
        for space, key in named:
            space[key] = joined
        if forced is not None:
            os.environ["RINGSIDE_BACKEND"] = forced


FIX = ("make it where the tensors it works with are (device=x.device, torch.empty_like(x), or the `device` "
       "argument), or move it there with .to(x.device)")


def device_diagnosis(function: str, error: BaseException) -> str | None:
    """One line for a tensor found in the wrong place while `function` ran on a stand-in GPU: which
    function, which tensor (where the learner's code made it, when known), and the fix. None when
    `error` is no such mistake."""
    if isinstance(error, StandInDeviceError):
        return f"{function}, run as on a GPU machine: {error} - use this rank's GPU, cuda:LOCAL_RANK"
    if not isinstance(error, DeviceMismatch):
        return None
    made = origin(error.tensor)
    text = str(error).split(": NCCL")[0]
    cause = " (NCCL refuses it)" if "NCCL" in str(error) else ""
    if made:
        which = f" - that tensor is made by {made} on the {error.tensor.device}"
    else:
        which = f" ({_where(error)})"
    return f"{function}, run as on a GPU machine: {text}{cause}{which}: {FIX}"


def misplaced_result(function: str, value, device: torch.device, what: str = "what it returned",
                     where: str = "where its inputs are") -> str | None:
    """One line when a tensor in `value` (a result of `function` on a stand-in GPU) is not on `device`."""
    for tensor in _tensors(value):
        if tensor.device != device:
            made = origin(tensor)
            return (f"{function}, run as on a GPU machine: {what} is on the {tensor.device}, not on {device} {where}"
                    + (f" - it is made by {made}" if made else "") + f": {FIX}")
    return None


def device_problem(function: str, call, *args, **kwargs) -> tuple[object, str | None]:
    """call(*args, **kwargs) inside `rank_gpu`: (its result, None), or (its result or None, the one
    line of `device_diagnosis`) when a tensor was in the wrong place: two devices met in an op (raised,
    as CUDA raises it), or a collective or send/recv was handed a tensor NCCL refuses (noted while the
    call ran on gloo: the first one is named). Any other error propagates, unless a refusal came first."""
    refused = _ACTIVE[-1].refused
    before = len(refused)
    try:
        result = call(*args, **kwargs)
    except (DeviceMismatch, StandInDeviceError) as error:
        return None, device_diagnosis(function, refused[before] if len(refused) > before else error)
    except Exception:
        if len(refused) > before:  # the consequence of a tensor NCCL would not have taken
            return None, device_diagnosis(function, refused[before])
        raise
    return result, (device_diagnosis(function, refused[before]) if len(refused) > before else None)


def not_checkable(function: str, error: BaseException) -> str:
    """The line a check prints where `function` cannot run on a stand-in GPU (StandInGPU.unjudgeable)."""
    return (f"device of {function}'s tensors: not checkable here ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:120]})")


def beyond_stand_in(name: str, error: BaseException) -> bool:
    """In the GPU-box rehearsal (ringside.gpubox: the whole rank on a stand-in GPU), whether `error` is
    the stand-in's limit, not the code's (StandInGPU.unjudgeable): then one line says that `name` cannot
    run here, and the check goes on without it. Always False on a CPU run and on a real GPU."""
    if not (_BOX and StandInGPU.unjudgeable(error)):
        return False
    from .runtime import print0
    print0(not_checkable(name, error))
    return True


def _where(error: BaseException) -> str:
    from .lab import _where as where
    return where(error)


def on_rank_gpu(name: str, run: Callable[[torch.device], object], *functions,
                what: str = "what it returned") -> tuple[str | None, str | None]:
    """run(device) as on a GPU machine (`rank_gpu`), `device` being this rank's stand-in GPU:
    (problem, note). problem: one line naming a tensor in the wrong place, raised on the way (CUDA's
    or NCCL's refusal) or among what run returned (`what`); note: one line when the code cannot run
    on a stand-in at all (StandInGPU.unjudgeable: nothing can be concluded), else None."""
    with rank_gpu(*functions) as (gpu, _):
        try:
            result, problem = device_problem(name, run, gpu.device)
        except Exception as error:
            if StandInGPU.unjudgeable(error):
                return None, not_checkable(name, error)
            raise
        return problem or misplaced_result(name, result, gpu.device, what), None


def passed_on_every_rank(checks) -> bool:
    """True on every rank when no rank has a failure yet (a collective: every rank must call it).
    The run on a stand-in GPU comes after the CPU verdict, and only where that passed everywhere: its
    collectives must be made by every rank, and a diagnosis of the CPU run stays the first one."""
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, not checks.failures)
    return all(verdicts)
