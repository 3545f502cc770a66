"""ringside.calls.Recorder: the one recorder of collectives and point-to-point calls that every
lab check reads. Each way of waiting must count as completion; a work never waited for must not."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as imported_all_reduce  # a name imported directly

from ringside import run_ranks
from ringside.calls import Recorder, lab_namespaces


def _uses_imported_name(t):
    return imported_all_reduce(t, async_op=True)


def _spin(predicate, limit=10.0):
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, "never finished"
        time.sleep(0.001)


def completion_paths(rank, world_size):
    """Each way of waiting, one all-reduce each: which calls ended completed, and how."""
    from torch.distributed import distributed_c10d as c10d

    seen = {}
    t = lambda: torch.ones(3)  # noqa: E731
    with Recorder(namespaces=lab_namespaces(_uses_imported_name)) as rec:
        dist.all_reduce(t())                                                   # 0 blocking
        dist.all_reduce(t(), async_op=True).wait()                             # 1 Work.wait
        dist.all_reduce(t(), async_op=True).get_future().wait()                # 2 future.wait
        out = dist.all_reduce(t(), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
        seen["then"] = out.wait().tolist()                                     # 3 .then
        future = dist.all_reduce(t(), async_op=True).get_future()              # 4 .value()
        _spin(lambda: torch.futures.Future.done(future))  # the base class's done: not a wait
        seen["value"] = future.value()[0].tolist()
        work = dist.all_reduce(t(), async_op=True)                             # 5 is_completed()
        _spin(work.is_completed)
        torch.futures.wait_all([dist.all_reduce(t(), async_op=True).get_future()])  # 6 wait_all
        torch.futures.collect_all([dist.all_reduce(t(), async_op=True).get_future()]).wait()  # 7
        never = dist.all_reduce(t(), async_op=True)                            # 8 never waited
        c10d.all_reduce(t())                                                   # 9 via distributed_c10d
        _uses_imported_name(t()).wait()                                        # 10 a name imported directly
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), right),
                                        dist.P2POp(dist.irecv, torch.zeros(2), left)])  # 11, 12
        for w in works:
            w.wait()
        late = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), right),
                                       dist.P2POp(dist.irecv, torch.zeros(2), left)])  # 13, 14: not waited
        calls = [(c.op, c.completed, c.completed_by) for c in rec.calls]
    never.wait()
    for w in late:
        w.wait()
    return seen, calls


def test_every_way_of_waiting_counts_as_completion():
    for seen, calls in run_ranks(completion_paths, 2, timeout=60):
        assert seen == {"then": [4.0, 4.0, 4.0], "value": [2.0, 2.0, 2.0]}
        assert [op for op, _, _ in calls] == ["all_reduce"] * 11 + ["isend", "irecv"] * 2
        assert [how for _, _, how in calls] == [
            "blocking", "wait", "future.wait", "then", "future.value", "is_completed", "wait_all",
            "future.wait", None, "blocking", "wait", "wait", "wait", None, None]
        assert [done for _, done, _ in calls] == [how is not None for _, _, how in calls]


def what_is_recorded(rank, world_size):
    """Op, dtype, bytes, peers, group, async: the fields every check reads."""
    pair = dist.new_group([0, 1])
    with Recorder(snapshot=True) as rec:
        x = torch.arange(6, dtype=torch.float64)
        dist.all_gather_into_tensor(torch.empty(6 * world_size, dtype=torch.float64), x)
        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.bfloat16), torch.ones(2 * world_size, dtype=torch.bfloat16))
        dist.broadcast(torch.ones(4, dtype=torch.int64), src=world_size - 1, group=pair if world_size == 2 else None)
        dist.all_gather_object([None] * world_size, {"rank": rank})  # its inner all_gather is not recorded again
        dist.barrier()
        if rank == 0:
            dist.send(torch.ones(5, dtype=torch.int32), dst=1, tag=3)
        elif rank == 1:
            dist.recv(torch.zeros(5, dtype=torch.int32), src=0, tag=3)
    return [{k: (str(v) if k in ("dtype", "reduce_op") else v)
             for k, v in c.items() if k in ("op", "family", "dtype", "bytes", "out_bytes", "peer", "root", "tag",
                                            "default_group", "group_ranks", "async_op", "completed")}
            | {"whole": c.whole_bytes, "snapshot": None if c.snapshot is None else [s.tolist() for s in c.snapshot]}
            for c in rec.calls]


def test_fields_of_each_call():
    calls = run_ranks(what_is_recorded, 2, timeout=60)
    gather, scatter, broadcast, objects, barrier, p2p = calls[0]
    assert gather | {} == {"op": "all_gather_into_tensor", "family": "all_gather", "dtype": "torch.float64",
                           "bytes": 48, "out_bytes": 96, "peer": None, "root": None, "tag": None,
                           "default_group": True, "group_ranks": (0, 1), "async_op": False, "completed": True,
                           "whole": 96, "snapshot": [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]}
    assert (scatter["family"], scatter["dtype"], scatter["bytes"], scatter["whole"]) == \
        ("reduce_scatter", "torch.bfloat16", 8, 8)
    assert (broadcast["root"], broadcast["default_group"], broadcast["group_ranks"]) == (1, False, (0, 1))
    assert objects["op"] == "all_gather_object" and objects["bytes"] == 0
    assert (barrier["op"], barrier["completed"], barrier["bytes"]) == ("barrier", True, 0)
    assert (p2p["op"], p2p["peer"], p2p["tag"], p2p["bytes"]) == ("send", 1, 3, 20)
    assert (calls[1][5]["op"], calls[1][5]["peer"]) == ("recv", 0)
    assert len(calls[1]) == 6


def test_restores_every_name():
    from torch.distributed import distributed_c10d as c10d
    before = (dist.all_reduce, c10d.all_reduce, dist.isend, torch.futures.wait_all, imported_all_reduce)
    with Recorder(namespaces=lab_namespaces(_uses_imported_name)):
        assert dist.all_reduce is c10d.all_reduce is globals()["imported_all_reduce"] is not before[0]
    assert (dist.all_reduce, c10d.all_reduce, dist.isend, torch.futures.wait_all,
            globals()["imported_all_reduce"]) == before


def writes_in_flight(rank, world_size):
    """Three async all-reduces: one left alone until its wait, one whose buffer is divided before the
    wait (the race lab 12's check names), one divided after it; an isend whose buffer is refilled before
    its wait too."""
    with Recorder() as rec:
        alone, early, late = torch.ones(3), torch.ones(3), torch.ones(3)
        dist.all_reduce(alone, async_op=True).wait()
        work = dist.all_reduce(early, async_op=True)
        early /= world_size  # in flight
        work.wait()
        dist.all_reduce(late, async_op=True).wait()
        late /= world_size  # done: no race
        peer = (rank + 1) % world_size
        buffer, arrived = torch.full((2,), float(rank)), torch.empty(2)
        works = [dist.isend(buffer, peer), dist.irecv(arrived, (rank - 1) % world_size)]
        buffer.fill_(-1.0)  # refilled while it may still be going out
        for w in works:
            w.wait()
    return [call["changed_in_flight"] for call in rec.calls]


def test_a_tensor_changed_while_its_request_is_in_flight_is_seen():
    for flags in run_ranks(writes_in_flight, 2, timeout=60):
        assert flags == [False, True, False, True, False], flags
