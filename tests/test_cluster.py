"""The simulated cluster (network namespaces, 1 Gbit/s links): where the ring all-reduce wins.

Needs root; elsewhere these tests are skipped with the reason."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import ROOT

from tools import cluster

REASON = cluster.why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
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


def test_ring_sits_on_the_bandwidth_bound_and_naive_does_not(four_hosts, tmp_path):
    out = tmp_path / "cluster.json"
    results = cluster.run_job(ROOT / "tools" / "cluster_bench.py", 4, "--sizes-mib", "16", "--reps", "9",
                              "--rate", "1gbit", "--out", str(out), timeout=240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    data = json.loads(out.read_text())
    rows = {row["method"]: row for row in data["rows"]}
    size, n, link = rows["ring"]["bytes"], data["hosts"], data["link_bytes_per_s"]
    bound = 2 * (n - 1) / n * size / link  # each host must send (and receive) 2(N-1)/N of the tensor
    # The best of 9 repetitions: on a shared machine other programs can only add time.
    ring, pipelined, naive = (rows[m]["best_seconds"] for m in ("ring", "ring_pipelined", "naive"))
    # The byte counter: every host sent 2(N-1)/N x S in the ring (plus TCP/IP headers, under 5 %).
    for sent in rows["ring"]["sent_per_host"] + rows["ring_pipelined"]["sent_per_host"]:
        assert 2 * (n - 1) / n * size <= sent <= 1.05 * 2 * (n - 1) / n * size
    # Measured here on 2 cores (best of 9): pipelined ring (8 pieces) 1.06x the bound, the lab's plain ring 1.11-1.22x
    # (each of its 6 steps pays a round trip and an addition while the link idles), naive 3.7x.
    assert pipelined <= 1.10 * bound, f"pipelined ring {pipelined * 1000:.0f} ms vs bound {bound * 1000:.0f} ms"
    assert ring <= 1.35 * bound, f"ring {ring * 1000:.0f} ms vs bound {bound * 1000:.0f} ms"
    assert naive >= 2 * ring, f"naive {naive * 1000:.0f} ms vs ring {ring * 1000:.0f} ms"


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
