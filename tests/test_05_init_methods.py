"""Chapter 05: a two-node job simulated on this machine (two torchrun processes, one c10d rendezvous
on 127.0.0.1), and the identity table it prints."""

from __future__ import annotations

from ringside.rendezvous import WHOAMI, identity_table, simulate_nodes


def test_two_nodes_on_one_machine():
    results = simulate_nodes(WHOAMI, nnodes=2, nproc=2, timeout=200)
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    table = identity_table(results)
    assert len(table) == 4, table
    for rank, line in enumerate(table):  # global rank = group rank x processes per node + local rank
        group_rank, local_rank = divmod(rank, 2)
        assert line.startswith(f"rank {rank} = group_rank {group_rank} x local_world_size 2 + "
                               f"local_rank {local_rank}   (world_size 4"), line
    # with the c10d rendezvous, node ranks are assigned by the rendezvous, and torchrun says so
    assert any("ignored for rdzv_backend=c10d" in r.stderr for r in results)
