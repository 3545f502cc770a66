"""run_ranks: ranks forked from a kernel, results in rank order, errors and hangs made visible."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ringside import RankError, RanksTimeout, run_ranks


def sum_ranks(rank, world_size, scale=1):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"I am {rank}")
    return scale * t.item()


def fail_on_two(rank, world_size):
    if rank == 2:
        raise ValueError("rank two is broken")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others wait for rank 2, which never comes


def recv_from_each_other(rank, world_size):
    t = torch.zeros(1)
    dist.recv(t, src=1 - rank)  # both ranks receive first: a deadlock


def test_results_and_output_in_rank_order(capsys):
    assert run_ranks(sum_ranks, 4, scale=2) == [12.0] * 4
    assert capsys.readouterr().out == "".join(f"[rank {r}] I am {r}\n" for r in range(4))


def test_runs_twice_in_a_row_in_one_process():
    assert run_ranks(sum_ranks, 2, show_output=False) == [1.0, 1.0]
    assert run_ranks(sum_ranks, 3, show_output=False) == [3.0, 3.0, 3.0]


def test_an_exception_names_its_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(fail_on_two, 4, timeout=30)
    assert caught.value.rank == 2
    assert "ValueError: rank two is broken" in str(caught.value)
    assert "fail_on_two" in str(caught.value)  # the traceback
    assert time.monotonic() - start < 15  # the other ranks are not waited for until the timeout


def test_a_deadlock_times_out_and_names_the_ranks():
    start = time.monotonic()
    with pytest.raises(RanksTimeout, match=r"rank\(s\) 0, 1 still running after 2 s .*deadlock"):
        run_ranks(recv_from_each_other, 2, timeout=2)
    assert time.monotonic() - start < 10


def test_refuses_when_cuda_was_initialized_in_the_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialized"):
        run_ranks(sum_ranks, 2)
