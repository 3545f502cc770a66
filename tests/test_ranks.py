"""run_ranks: ranks forked from a kernel, results in rank order, errors and hangs made visible."""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def parent_of_rank(rank, world_size):
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()  # a rank runs autograd too
    return os.getppid()


def test_ranks_never_fork_from_a_process_that_ran_autograd():
    """On a machine with CUDA, a process forked after its parent ran backward() cannot run backward()
    itself (this cannot be reproduced without CUDA). So the kernel never forks: a fresh rank starter,
    which never runs autograd, does - also after the kernel has trained something."""
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()  # the "kernel" runs autograd first
    parents = run_ranks(parent_of_rank, 2, show_output=False)
    assert len(set(parents)) == 1 and parents[0] != os.getpid()
    starter = Path(f"/proc/{parents[0]}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "from ringside.launch import _serve" in starter  # started by exec, not forked from us
    assert run_ranks(parent_of_rank, 3, show_output=False) == [parents[0]] * 3  # one starter, reused


class Counter:  # a class defined where the ranks cannot import it by name (like a notebook's)
    def __init__(self, n):
        self.n = n


def test_functions_and_classes_travel_by_value():
    offset = 10  # a closure over the caller's local variable, as a notebook cell's function has

    def shifted(rank, world_size):
        return Counter(rank + offset)

    assert [c.n for c in run_ranks(shifted, 2, show_output=False)] == [10, 11]


def test_a_cell_interrupted_leaves_no_rank_behind():
    """Ctrl-C in the kernel (here: a timeout of the backstop) stops the starter and its ranks;
    the next call starts a new one."""
    from ringside.launch import _Starter

    run_ranks(sum_ranks, 2, show_output=False)
    first = _Starter.current.proc.pid
    _Starter.current.stop()
    assert run_ranks(sum_ranks, 2, show_output=False) == [1.0, 1.0]
    assert _Starter.current.proc.pid != first


def test_a_reserved_port_goes_to_no_other_bind_yet_a_store_can_serve_on_it():
    """fork_script and free_port reserve their port: a port merely found free was once taken by another
    test's launch before rank 0 listened on it ("failed to listen on any local network address")."""
    import socket
    from datetime import timedelta

    from ringside.launch import free_port, reserved_port

    def autobind() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    with reserved_port() as port:
        kept = free_port()
        taken = {autobind() for _ in range(20_000)}  # without a reservation, a freed port comes back within this
        assert port not in taken and kept not in taken
        for use_libuv in (True, False):
            store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), use_libuv=use_libuv)
            store.set("key", "value")
            assert store.get("key") == b"value"
            del store


def test_fork_script_from_two_threads_at_once_gives_each_its_own_ranks(tmp_path):
    """The rank starter serves one job at a time on its pipe: two threads of one process that call
    fork_script together each get their own ranks' output, not the other's."""
    import threading

    from ringside.launch import fork_script

    script = tmp_path / "say.py"
    script.write_text("import os, sys\nprint(sys.argv[1], os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    results = {}

    def run(word: str, n: int) -> None:
        results[word] = fork_script(script, n, word, timeout=60)

    threads = [threading.Thread(target=run, args=(word, n)) for word, n in (("left", 2), ("right", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results["left"].stdout.split("\n")[:2]) == ["left 0 2", "left 1 2"], results["left"]
    assert sorted(results["right"].stdout.split("\n")[:3]) == ["right 0 3", "right 1 3", "right 2 3"], results["right"]


def test_torchrun_script_in_a_room_forks_and_shows_what_torchrun_shows(tmp_path, monkeypatch):
    """RINGSIDE_LAUNCH=fork (a workshop room): torchrun_script's ranks are forked from the rank
    starter, and the cell shows what the real torchrun shows: rank 0's output, the exit status of
    the job (1 when a rank fails)."""
    from ringside.launch import torchrun_script

    script = tmp_path / "say.py"
    # rank 1 fails once rank 0 has printed: torchrun then stops the others (SIGTERM), which must not
    # cut rank 0's line short whichever rank starts first
    script.write_text("import os, sys, time\nfrom pathlib import Path\n"
                      "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n"
                      "printed = Path(sys.argv[2]) / f\"printed-{os.environ['RANK']}\"\n"
                      "printed.touch()\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    deadline = time.monotonic() + 60\n"
                      "    while not (printed.parent / 'printed-0').exists() and time.monotonic() < deadline:\n"
                      "        time.sleep(0.01)\n"
                      "sys.exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n")
    runs = lambda: [torchrun_script(script, 3, code, folder, check=False, show=False, timeout=120)  # noqa: E731
                    for code, folder in (("0", tmp_path / "a"), ("3", tmp_path / "b"))]
    for folder in "ab":
        (tmp_path / folder).mkdir()
    real = runs()
    monkeypatch.setenv("RINGSIDE_LAUNCH", "fork")
    for marker in tmp_path.glob("*/printed-*"):
        marker.unlink()
    forked = runs()
    assert [r.stdout for r in forked] == [r.stdout for r in real] == ["rank 0 of 3\n"] * 2
    assert [r.returncode for r in forked] == [0, 1] and real[0].returncode == 0 and real[1].returncode != 0
