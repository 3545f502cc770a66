"""The one recorder of a rank's communication, at the c10d boundary, for every lab check.

    from ringside.calls import Recorder, lab_namespaces

    with Recorder(namespaces=lab_namespaces(learner_function)) as rec:
        learner_function(...)
    rec.calls   # every collective and point-to-point call, in the order made (a list of Call)
    rec.ops     # the point-to-point ones only (send, recv, isend, irecv), as labs 02-04 read them

What is recorded
----------------
Every call of `all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter,
reduce_scatter_tensor, all_to_all, all_to_all_single, reduce, gather, scatter, barrier, send,
recv, isend, irecv` (and `batch_isend_irecv`'s sends and receives, the `*_single` and
`*_coalesced` spellings and the `*_object` collectives where the installed torch has them) made
while the block runs, whichever name it was called through: `torch.distributed.X`,
`torch.distributed.distributed_c10d.X`, or a name the learner's module imported directly
(`from torch.distributed import all_reduce`): pass that module's globals in `namespaces`
(`lab_namespaces(*functions_or_classes)` finds them). A call made by torch inside a recorded call
(all_gather_object's all_gather, *_single's older spelling) is not recorded again. Calls made on a
ProcessGroup object directly (`group.allreduce(...)`) are below the boundary and not seen.

Each `Call` is a dict whose keys read as attributes too (`call.op` or `call["op"]`):

    index         its place in rec.calls
    op, kind      the name called ("all_reduce", "isend", "all_gather_single", ...)
    family        the operation whatever its spelling: all_gather_into_tensor and all_gather_single
                  are "all_gather", reduce_scatter_tensor/_single "reduce_scatter", isend "send", ...
    p2p           True for send, recv, isend, irecv
    tensor        the tensor this rank hands in (a p2p call's buffer, sent or received into), or None
    tensors       every tensor it hands in;   outputs: weak references to the tensors it writes
    ptr           tensor.data_ptr() (0 without a tensor)
    dtype, device of the first tensor handed in or written (None for barrier and *_object calls)
    numel, bytes  elements and bytes (numel * element size) handed in
    out_numel, out_bytes   the same for what it writes;   whole_bytes: the larger of the two
                  (an all_gather's full output, a reduce_scatter's full input)
    reduce_op     the ReduceOp of a reduction (None otherwise)
    peer          a p2p call's peer as a global rank (None: a receive from any source)
    root          a rooted collective's src/dst as a global rank
    group         the group passed (None: the default group);  default_group: True if so
    group_ranks   the global ranks of that group, in group-rank order
    tag           a p2p call's tag
    async_op      True for isend/irecv and for async_op=True;   batch: posted in batch_isend_irecv
    completed     True once the learner's code saw the call finish, whichever way it waited:
                  a blocking call (at return), Work.wait(), Work.synchronize(), is_completed()
                  returning True, work.get_future() then .wait(), .value(), .done() returning
                  True, a .then(...) or add_done_callback(...) callback that ran, and
                  torch.futures.wait_all / collect_all(...).wait() over those futures;
                  the works batch_isend_irecv returns complete the ops they cover
    completed_by  which of those came first ("blocking", "wait", "future.wait", "then", ...)
    waited        the same as completed (the older name, labs 02-04)
    pending       the indices of the calls not completed when this one was posted
    work          the real Work of an async call (the check may wait on it itself, once the learner's
                  code has returned, to drain what it left in flight; that does not mark it completed)
    refused       True if the call was refused (see `refuse`) or stopped by `on_call`
    misplaced     on a stand-in GPU (ringside.standin): the DeviceMismatch NCCL would raise for a tensor
                  not on this rank's GPU (the call still runs on gloo; StandInGPU.refused lists them), else None
    snapshot      a copy of what it hands in, taken before it ran (Recorder(snapshot=True) only)
    changed_in_flight  True if the learner's code wrote (in place) into a tensor of an async call
                  after posting it and before it completed: the data sent, or the result, is then
                  whatever the race left (read from the tensors' version counters; None until completed)

Options
-------
    Recorder(namespaces=(), refuse=(), on_call=None, on_complete=None, snapshot=False)

`refuse`: names whose call raises RuntimeError (`refused(name)`: a lab that builds everything from
point-to-point messages); `on_call(call)` runs before each recorded call is made and may raise to
stop it (a collective on a group the lab must not use, say); its exception reaches the learner's
code as the call's. `on_complete(call)` runs once a call is completed (see `completed`), to place
that moment among events of the check's own (a `.then` callback's completion runs on the thread
that finished the work). `rec.of("all_reduce", ...)` lists the calls of those families or names. The learner's calls otherwise go through to torch.distributed unchanged: the
works and futures they get back are stand-ins that note completion and hand everything else to
the real ones (isinstance(work, dist.Work) does not hold for them).

`DryRun` records the point-to-point calls without sending anything, so a learner's function can be
rehearsed before it runs for real: a wrong peer or a deadlock is then named at once, never after a
timeout.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .standin import StandInTensor, for_gloo

P2P = ("send", "recv", "isend", "irecv")

# name -> (parameter handed in, parameter written, parameter naming the root, its group-rank form)
SHAPES = {
    "all_reduce": ("tensor", "tensor", None, None),
    "all_reduce_coalesced": ("tensors", "tensors", None, None),
    "broadcast": ("tensor", "tensor", "src", "group_src"),
    "all_gather": ("tensor", "tensor_list", None, None),
    "all_gather_into_tensor": ("input_tensor", "output_tensor", None, None),
    "all_gather_single": ("input_tensor", "output_tensor", None, None),
    "all_gather_coalesced": ("input_tensor_list", "output_tensor_lists", None, None),
    "reduce_scatter": ("input_list", "output", None, None),
    "reduce_scatter_tensor": ("input", "output", None, None),
    "reduce_scatter_single": ("input", "output", None, None),
    "all_to_all": ("input_tensor_list", "output_tensor_list", None, None),
    "all_to_all_single": ("input", "output", None, None),
    "reduce": ("tensor", "tensor", "dst", "group_dst"),
    "gather": ("tensor", "gather_list", "dst", "group_dst"),
    "gather_single": ("tensor", "gather_tensor", "dst", "group_dst"),
    "scatter": ("scatter_list", "tensor", "src", "group_src"),
    "barrier": (None, None, None, None),
    "broadcast_object_list": (None, None, "src", "group_src"),
    "all_gather_object": (None, None, None, None),
    "gather_object": (None, None, "dst", "group_dst"),
    "scatter_object_list": (None, None, "src", "group_src"),
    "send": ("tensor", None, "dst", "group_dst"),
    "isend": ("tensor", None, "dst", "group_dst"),
    "recv": (None, "tensor", "src", "group_src"),
    "irecv": (None, "tensor", "src", "group_src"),
}
COLLECTIVES = tuple(name for name in SHAPES if name not in P2P)
FAMILY = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
          "all_gather_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "reduce_scatter_single": "reduce_scatter", "all_reduce_coalesced": "all_reduce",
          "all_to_all_single": "all_to_all", "gather_single": "gather", "isend": "send", "irecv": "recv"}


class Call(dict):
    """One recorded call: a dict whose keys read as attributes too (see the module docstring)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def whole_bytes(self) -> int:
        return max(self["bytes"], self["out_bytes"])

    @property
    def alive(self) -> bool:
        """Whether any tensor this call wrote is still referenced somewhere."""
        return any(ref() is not None for ref in self["outputs"])

    def complete(self, how: str) -> None:
        if not self["completed"]:
            self["completed"], self["waited"], self["completed_by"] = True, True, how
            self["changed_in_flight"] = any(ref() is not None and _version(ref()) != version
                                            for ref, version in self.get("versions", ()))
            # let go of the real work: its future holds what the call wrote (through the relay to
            # the learner's future), which must be freed when the learner's code drops it
            self["work"] = None
            notify = getattr(self, "_on_complete", None)
            if notify is not None:
                notify(self)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (each in-place write moves it); None for an inference tensor."""
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an argument: a tensor, a list of them, or a list of lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _global(group, rank, group_rank):
    """A peer or root as a global rank, from its global or its group-rank form."""
    if rank is not None or group_rank is None:
        return rank
    try:
        return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)
    except Exception:  # a dry run outside a group, say: keep the number given
        return group_rank


def _ranks(group) -> tuple[int, ...] | None:
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except Exception:
        return None


class Recorder:
    """While active, every collective and point-to-point call is recorded as a Call in `calls`
    (the point-to-point ones also in `ops`); see the module docstring."""

    def __init__(self, refuse: tuple[str, ...] = (), namespaces=(), on_call=None, on_complete=None,
                 snapshot: bool = False):
        self.calls: list[Call] = []
        self.ops: list[Call] = []
        self.in_batch = False
        self.refuse = tuple(refuse)
        self.namespaces = list(namespaces)
        self.on_call, self.on_complete, self.snapshot = on_call, on_complete, snapshot
        self._local = threading.local()

    # --- recording ------------------------------------------------------------------------------

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _note(self, name: str, signature, args, kwargs) -> Call:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        given, written, root, group_root = SHAPES[name]
        inputs = _tensors(arguments.get(given)) if given else []
        outputs = _tensors(arguments.get(written)) if written else []
        if name in P2P:
            inputs = outputs = _tensors(arguments.get("tensor"))
        group = arguments.get("group")
        peer = _global(group, arguments.get(root), arguments.get(group_root)) if root else None
        first = (inputs or outputs or [None])[0]
        call = Call(
            index=len(self.calls), op=name, kind=name, family=FAMILY.get(name, name), p2p=name in P2P,
            tensor=inputs[0] if len(inputs) == 1 else None, tensors=inputs,
            outputs=[weakref.ref(t) for t in outputs],
            ptr=first.data_ptr() if first is not None else 0,
            dtype=first.dtype if first is not None else None, device=first.device if first is not None else None,
            numel=sum(t.numel() for t in inputs), bytes=sum(t.numel() * t.element_size() for t in inputs),
            out_numel=sum(t.numel() for t in outputs),
            out_bytes=sum(t.numel() * t.element_size() for t in outputs),
            reduce_op=arguments.get("op", dist.ReduceOp.SUM if name in ("all_reduce", "reduce", "reduce_scatter",
                                                                       "reduce_scatter_tensor",
                                                                       "reduce_scatter_single") else None),
            peer=peer if name in P2P else None, root=None if name in P2P else peer,
            group=group, default_group=group is None or group is dist.group.WORLD, group_ranks=_ranks(group),
            tag=arguments.get("tag", 0) if name in P2P else None,
            async_op=name in ("isend", "irecv") or bool(arguments.get("async_op", False)),
            batch=self.in_batch, work=None, completed=False, waited=False, completed_by=None,
            pending=[c["index"] for c in self.calls if not c["completed"]], changed_in_flight=None,
            snapshot=[t.detach().clone() for t in inputs] if self.snapshot else None)
        call._on_complete = self.on_complete
        self.calls.append(call)
        if name in P2P:
            self.ops.append(call)
        return call

    def _wrap(self, kind: str, original):
        """The stand-in for one function: record, then call the original (or refuse)."""
        signature = inspect.signature(original)
        refuse = kind in self.refuse
        outer = getattr(original, "recorded", False)

        def call(*args, **kwargs):
            if self._depth():  # torch calling on inside a recorded call (a torch-function handler, too)
                return original(*args, **kwargs)
            noted = self._note(kind, signature, args, kwargs)
            noted["refused"] = refuse
            # on a stand-in GPU: gloo gets the CPU data; a tensor NCCL would refuse is noted as refused
            # (StandInGPU.refused, `misplaced`) but the call runs, so that no rank is left waiting
            bound = signature.bind_partial(*args, **kwargs)
            # (an outer Recorder's stand-in, which this one calls on, does that once for both)
            arguments, misplaced = (bound.arguments, None) if outer else for_gloo(kind, bound.arguments)
            if arguments is not bound.arguments:
                bound.arguments.update(arguments)
                args, kwargs = bound.args, bound.kwargs
            noted["misplaced"] = misplaced
            if refuse:
                noted.complete("refused")
                return refused(kind)()
            if self.on_call is not None:
                try:
                    self.on_call(noted)
                except BaseException:  # stopped before it ran: nothing is in flight
                    noted["refused"] = True
                    noted.complete("refused")
                    raise
            self._local.depth = self._depth() + 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._local.depth -= 1
            if not noted["async_op"]:
                noted.complete("blocking")
                return result
            noted["work"] = result
            # each tensor's version counter once posted (the call's own write counts already): an
            # in-place write by the learner's code before completion moves it. Only tensors with memory
            # of their own: a view shares its base's counter, so a write to another part of the base
            # (another bucket of one flat buffer, say: no race) would move it too.
            noted["versions"] = [(weakref.ref(t), _version(t)) for t in
                                 {id(t): t for t in noted["tensors"] + [r() for r in noted["outputs"]]
                                  if t is not None and t._base is None}.values()]
            return Recorded(result, [noted]) if result is not None else result
        call.__wrapped__, call.recorded = original, True
        return call

    def _batch(self, original):
        def call(ops):
            self.in_batch, first = True, len(self.calls)
            try:
                works = original(ops)
            finally:
                self.in_batch = False
            # gloo: one request per op, already recorded; NCCL: requests of the whole group
            return [work if isinstance(work, Recorded) else Recorded(work, self.calls[first:]) for work in works]
        return call

    # --- entering and leaving -------------------------------------------------------------------

    def __enter__(self):
        from torch.distributed import distributed_c10d as c10d
        names = [name for name in SHAPES if hasattr(c10d, name)] + \
                [name for name in self.refuse if name not in SHAPES and hasattr(dist, name)]
        originals = {name: getattr(c10d, name, None) or getattr(dist, name) for name in names}
        # one stand-in per function, the same object everywhere (P2POp checks `op is isend`)
        stand_ins = {name: (self._wrap(name, original) if name in SHAPES else refused(name))
                     for name, original in originals.items()}
        stand_ins["batch_isend_irecv"] = self._batch(c10d.batch_isend_irecv)
        originals["batch_isend_irecv"] = c10d.batch_isend_irecv
        known = {}
        for name, original in originals.items():
            known[id(original)] = name
            if hasattr(dist, name):
                known[id(getattr(dist, name))] = name
        self.saved = []
        for space in [vars(dist), vars(c10d)] + list(self.namespaces):
            for key, value in list(space.items()):
                name = known.get(id(value))
                if name is not None and (key == name or space not in (vars(dist), vars(c10d))):
                    self.saved.append((space, key, value))
                    space[key] = stand_ins[name]
        self.saved.append((vars(torch.futures), "wait_all", torch.futures.wait_all))
        self.saved.append((vars(torch.futures), "collect_all", torch.futures.collect_all))
        torch.futures.wait_all, torch.futures.collect_all = _wait_all, _collect_all
        return self

    def __exit__(self, *exc):
        for space, key, original in reversed(self.saved):
            space[key] = original

    # --- reading --------------------------------------------------------------------------------

    def of(self, *families: str) -> list[Call]:
        """The recorded calls of these families (or ops), in order."""
        return [c for c in self.calls if c.get("family") in families or c.get("op") in families]


def lab_namespaces(*objects) -> list[dict]:
    """The global namespaces of the modules these functions and classes (or a namespace object
    holding them) were written in: where `from torch.distributed import all_reduce` put the
    learner's own name for the function. A decorator's wrapper has its own module's: skipped."""
    spaces, todo = [], list(objects)
    while todo:
        value = todo.pop()
        if hasattr(value, "__dict__") and not callable(value):  # a SimpleNamespace of the lab's things
            todo += [v for v in vars(value).values() if callable(v)]
            continue
        functions = [value] + ([f for f in vars(value).values() if callable(f)] if isinstance(value, type) else [])
        for function in functions:
            space = getattr(function, "__globals__", None)
            if (space is not None and space.get("__name__") == getattr(function, "__module__", None)
                    and all(space is not known for known in spaces)):
                spaces.append(space)
    return spaces


class Recorded:
    """A work whose completion is noted, whichever way the learner's code waits for it;
    everything else is the real work's."""

    def __init__(self, work, ops: list[Call]):
        self.work, self.ops = work, ops

    def _done(self, how: str) -> None:
        for op in self.ops:
            op.complete(how)

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        self._done("wait")
        return result

    def synchronize(self, *args, **kwargs):
        result = self.work.synchronize(*args, **kwargs)
        self._done("synchronize")
        return result

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        if done:
            self._done("is_completed")
        return done

    def get_future(self):
        return Watched(self.work.get_future(), self.ops)

    def __getattr__(self, name):
        return getattr(self.work, name)


class Watched(torch.futures.Future):
    """The future of a recorded work: a Future of its own, completed with the real one's value,
    that notes completion when the learner's code waits on it, reads its value, finds it done,
    or has a callback run by it."""

    def __init__(self, real, ops: list[Call]):
        super().__init__()
        self.ops = ops
        # on a stand-in GPU gloo ran on each tensor's CPU data: the value is the tensors handed in
        handed = [t for op in ops for t in [*op.get("tensors", []), *(r() for r in op.get("outputs", []))]]
        self.handed = {id(t.held): t for t in handed if isinstance(t, StandInTensor)}
        real.add_done_callback(self._relay)

    def _relay(self, real) -> None:
        try:
            value = real.value()
            self.set_result(tree_map(lambda v: self.handed.get(id(v), v), value) if self.handed else value)
        except Exception as error:  # the work failed: the learner's wait raises it
            self.set_exception(error)

    def _done(self, how: str) -> None:
        for op in self.ops:
            op.complete(how)

    def wait(self):
        result = super().wait()
        self._done("future.wait")
        return result

    def value(self):
        result = super().value()
        self._done("future.value")
        return result

    def done(self) -> bool:
        finished = super().done()
        if finished:
            self._done("future.done")
        return finished

    def then(self, callback):
        def ran(future):
            self._done("then")
            return callback(future)
        return super().then(ran)

    def add_done_callback(self, callback) -> None:
        def ran(future):
            self._done("add_done_callback")
            return callback(future)
        super().add_done_callback(ran)


_real_wait_all, _real_collect_all = torch.futures.wait_all, torch.futures.collect_all


def _wait_all(futures):
    result = _real_wait_all(futures)
    for future in futures:
        if isinstance(future, Watched):
            future._done("wait_all")
    return result


def _collect_all(futures):
    ops = [op for future in futures if isinstance(future, Watched) for op in future.ops]
    return Watched(_real_collect_all(futures), ops) if ops else _real_collect_all(futures)


def refused(name: str):
    def collective(*args, **kwargs):
        raise RuntimeError(f"dist.{name} was called: this lab builds everything from point-to-point "
                           f"calls (send/recv, isend/irecv, batch_isend_irecv) only")
    return collective


class DryRun(Recorder):
    """A Recorder whose point-to-point calls go nowhere: the learner's function runs once "on
    paper". A receive delivers `arrives` into its buffer (when its request is waited on, or at once
    for a blocking recv; None leaves the buffer alone), each op notes the value sent (`sent`), and
    with `plays=(rank, world_size)` this process answers dist.get_rank/get_world_size as that rank."""

    def __init__(self, refuse: tuple[str, ...] = (), arrives: float | None = None,
                 plays: tuple[int, int] | None = None, namespaces=()):
        super().__init__(refuse, namespaces=namespaces)
        self.arrives, self.plays = arrives, plays

    def _wrap(self, kind, original):
        if kind not in P2P:
            return super()._wrap(kind, original)

        def nowhere(tensor, *args, **kwargs):
            handed = self.ops[-1]["tensor"]  # as handed in (on a stand-in GPU, `tensor` is its CPU data)
            self.ops[-1]["sent"] = handed.detach().clone() if "send" in kind else None
            into = tensor if "recv" in kind and self.arrives is not None else None
            if kind == "recv" and into is not None:
                into.fill_(self.arrives)
            return Delivered(into, self.arrives) if kind in ("isend", "irecv") else None
        nowhere.__signature__ = inspect.signature(original)
        return super()._wrap(kind, nowhere)

    def _batch(self, original):
        return super()._batch(lambda ops: [op.op(op.tensor, op.peer) for op in ops])

    def __enter__(self):
        super().__enter__()
        if self.plays is not None:
            rank, world_size = self.plays
            self.saved += [(vars(dist), "get_rank", dist.get_rank), (vars(dist), "get_world_size", dist.get_world_size)]
            dist.get_rank, dist.get_world_size = (lambda group=None: rank), (lambda group=None: world_size)
        return self


class Delivered:
    """The request of a dry-run isend/irecv: done at once; wait() (or is_completed(), which finds it
    done) delivers into a receive's buffer."""

    def __init__(self, into=None, value=None):
        self.into, self.value = into, value

    def wait(self, *args, **kwargs) -> bool:
        if self.into is not None:
            self.into.fill_(self.value)
        return True

    def is_completed(self) -> bool:
        return self.wait()
