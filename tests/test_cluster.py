"""The simulated cluster (network namespaces, 1 Gbit/s links): where the ring all-reduce wins.

Needs root; elsewhere these tests are skipped with the reason."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import ROOT

from tools import cluster

REASON = cluster.why_not()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow(2)]
MiB = 1024 * 1024


@pytest.fixture
def four_hosts():
    cluster.up(4, "1gbit")
    try:
        yield
    finally:
        cluster.down()
        assert cluster.namespaces() == [], "the cluster's namespaces are still there after down()"
        leftover = subprocess.run(["pgrep", "-f", "cluster_bench"], capture_output=True, text=True).stdout
        assert not leftover.strip(), f"processes of the job are still running: {leftover}"


def test_ring_sends_2_n_minus_1_over_n_per_host_and_naive_piles_on_the_root(four_hosts, tmp_path):
    """What the interface counters show, which no load on the machine changes. (How close each method
    comes to the bandwidth bound is a measurement: `make cluster-bench`, chapter 04 - not a test.)"""
    out = tmp_path / "cluster.json"
    results = cluster.run_job(ROOT / "tools" / "cluster_bench.py", 4, "--sizes-mib", "16", "--reps", "2",
                              "--rate", "1gbit", "--out", str(out), timeout=240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    data = json.loads(out.read_text())
    rows = {row["method"]: row for row in data["rows"]}
    size, n = rows["ring"]["bytes"], data["hosts"]
    # The ring: every host sent 2(N-1)/N x S (plus TCP/IP headers, under 5 %), the pipelined ring too.
    for sent in rows["ring"]["sent_per_host"] + rows["ring_pipelined"]["sent_per_host"]:
        assert 2 * (n - 1) / n * size <= sent <= 1.05 * 2 * (n - 1) / n * size
    # Naive: the root sends the sum to N-1 hosts and receives N-1 tensors; the others one each way.
    root_sent, root_received = rows["naive"]["sent_per_host"][0], rows["naive"]["received_per_host"][0]
    assert (n - 1) * size <= root_sent <= 1.05 * (n - 1) * size
    assert (n - 1) * size <= root_received <= 1.05 * (n - 1) * size
    for sent in rows["naive"]["sent_per_host"][1:]:
        assert size <= sent <= 1.05 * size


def test_no_half_made_cluster_after_a_failure():
    with pytest.raises(cluster.ClusterError, match="tc"):
        cluster.up(3, rate="fast")  # the switch and a host exist when tc refuses the rate
    assert cluster.namespaces() == []


def test_a_two_node_job_on_two_hosts_of_their_own():
    """Chapter 05's table, with each node on its own address and the static rendezvous."""
    from ringside.rendezvous import WHOAMI, identity_table

    cluster.up(2, "1gbit")
    try:
        hosts = cluster.run_job(WHOAMI, 2, nproc_per_host=2, timeout=180)
    finally:
        cluster.down()
    assert [h.returncode for h in hosts] == [0, 0], [h.stderr[-2000:] for h in hosts]
    assert identity_table(hosts) == [
        f"rank {r} = group_rank {r // 2} x local_world_size 2 + local_rank {r % 2}   "
        f"(world_size 4, --local-rank argument: -)" for r in range(4)]
    assert cluster.namespaces() == []
