"""Recording a rank's point-to-point calls, for the self-checks of labs 02, 03 and 04.

    with Recorder(refuse=("all_reduce", ...)) as calls:
        learners_function()
    calls.ops  # one dict per send/recv/isend/irecv: kind, peer, tag, buffer, batched?, waited?

A check that sees the calls can name a mistake that the values alone cannot: a wait inside a
function meant to return its requests, a receive from any source, tags, a collective where the lab
asks for point-to-point messages only. `DryRun` records the calls without sending anything, so a
learner's function can be rehearsed before it runs for real: a wrong peer or a deadlock is then
named at once, never after a timeout.
"""

from __future__ import annotations

import torch.distributed as dist


class Recorder:
    """While active, every point-to-point call is noted (kind, peer, tag, buffer, whether it was
    posted inside dist.batch_isend_irecv, whether it was waited for) and the collectives raise.
    The learner's calls still go through to torch.distributed unchanged."""

    P2P = ("send", "recv", "isend", "irecv")

    def __init__(self, refuse: tuple[str, ...] = ()):
        self.ops: list[dict] = []
        self.in_batch = False
        self.refuse = refuse

    def _wrap(self, kind: str, original):
        def call(tensor, *args, **kwargs):
            names = ("dst", "group_dst") if "send" in kind else ("src", "group_src")
            peer = args[0] if args else kwargs.get(names[0], kwargs.get(names[1]))
            tag = kwargs.get("tag", args[2] if len(args) > 2 else 0)
            op = {"kind": kind, "peer": peer, "tag": tag, "ptr": tensor.data_ptr(), "tensor": tensor,
                  "batch": self.in_batch, "waited": kind in ("send", "recv"), "index": len(self.ops),
                  "pending": [o["index"] for o in self.ops if not o["waited"]]}
            self.ops.append(op)
            result = original(tensor, *args, **kwargs)
            return Recorded(result, [op]) if kind in ("isend", "irecv") and result is not None else result
        return call

    def _batch(self, original):
        def call(ops):
            self.in_batch, first = True, len(self.ops)
            try:
                works = original(ops)
            finally:
                self.in_batch = False
            # gloo: one request per op, already recorded; NCCL: requests of the whole group
            return [work if isinstance(work, Recorded) else Recorded(work, self.ops[first:]) for work in works]
        return call

    def __enter__(self):
        # torch.distributed and the module it comes from (P2POp compares its op with the latter's isend)
        from torch.distributed import distributed_c10d as c10d
        self.saved = [(module, name, getattr(module, name)) for module in (dist, c10d)
                      for name in (*self.P2P, "batch_isend_irecv", *(self.refuse if module is dist else ()))]
        # one stand-in per function, the same object in both modules (P2POp checks `op is isend`)
        stand_ins = {name: self._wrap(name, getattr(dist, name)) for name in self.P2P}
        stand_ins["batch_isend_irecv"] = self._batch(dist.batch_isend_irecv)
        for module, name, original in self.saved:
            setattr(module, name, stand_ins.get(name) or refused(name))
        return self

    def __exit__(self, *exc):
        for module, name, original in self.saved:
            setattr(module, name, original)


class Recorded:
    """A request whose wait() is noted; everything else is the real request's."""

    def __init__(self, work, ops: list[dict]):
        self.work, self.ops = work, ops

    def wait(self, *args, **kwargs):
        for op in self.ops:
            op["waited"] = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


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
                 plays: tuple[int, int] | None = None):
        super().__init__(refuse)
        self.arrives, self.plays = arrives, plays

    def _wrap(self, kind, original):
        def nowhere(tensor, *args, **kwargs):
            self.ops[-1]["sent"] = tensor.detach().clone() if "send" in kind else None
            into = tensor if "recv" in kind and self.arrives is not None else None
            if kind == "recv" and into is not None:
                into.fill_(self.arrives)
            return Delivered(into, self.arrives) if kind in ("isend", "irecv") else None
        return super()._wrap(kind, nowhere)

    def _batch(self, original):
        return super()._batch(lambda ops: [op.op(op.tensor, op.peer) for op in ops])

    def __enter__(self):
        super().__enter__()
        if self.plays is not None:
            rank, world_size = self.plays
            self.saved += [(dist, "get_rank", dist.get_rank), (dist, "get_world_size", dist.get_world_size)]
            dist.get_rank, dist.get_world_size = (lambda group=None: rank), (lambda group=None: world_size)
        return self


class Delivered:
    """The request of a dry-run isend/irecv: done at once; wait() delivers into a receive's buffer."""

    def __init__(self, into=None, value=None):
        self.into, self.value = into, value

    def wait(self, *args, **kwargs) -> bool:
        if self.into is not None:
            self.into.fill_(self.value)
        return True

    def is_completed(self) -> bool:
        return True
