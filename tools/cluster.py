"""A cluster on one machine: hosts in network namespaces, on one switch, with rate-limited links.

On one machine every rank shares the memory bus, so the ring all-reduce's point (each link carries
2(N-1)/N of the data, while a root carries N-1 times it) cannot show. Here each "host" is a Linux
network namespace with its own address and its own interface `eth0`, plugged into a bridge (the
switch, itself in a namespace) through a veth cable limited with `tc tbf` in both directions.
Nothing is added to the machine's own network namespace, and only the hosts' own addresses are used.

    python -m tools.cluster up --hosts 4 --rate 1gbit      (make cluster N=4 RATE=1gbit)
    python -m tools.cluster run --hosts 4 SCRIPT [ARGS]    (one torchrun per host)
    python -m tools.cluster down                           (make cluster-down)

It needs root (CAP_NET_ADMIN) and iproute2; without them it says so in one line and changes nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ringside import ring
from ringside.launch import ROOT, torchrun_command, torchrun_nodes

PREFIX = "rs-"  # every namespace this module makes starts with it, and `down` removes only those
SWITCH = "rs-sw"
SUBNET = "10.77.0"  # the hosts are 10.77.0.1 .. 10.77.0.N, on their own isolated bridge
PORT = 29500  # free by construction: the namespaces are new


class ClusterError(RuntimeError):
    pass


def host(i: int) -> str:
    return f"{PREFIX}h{i}"


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def _run(*cmd: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)}: {result.stderr.strip()}")
    return result.stdout


def why_not() -> str | None:
    """None when this process can build a cluster, else the reason in one line."""
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces and tc); run it as root, or skip it"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the simulated cluster needs '{tool}' from iproute2 (apt-get install iproute2)"
    return None


def namespaces() -> list[str]:
    """The namespaces of a cluster made here (ours only, by prefix)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


LOCK = Path("/run/lock/ringside-cluster.lock") if Path("/run/lock").is_dir() else Path("/tmp/ringside-cluster.lock")
_held: list = []  # the open lock file while this process owns the cluster


def _take_the_cluster(wait_s: float = 900) -> None:
    """One cluster per machine: wait (up to wait_s) until no other process holds it. Two jobs
    building their own clusters at once would tear down each other's hosts. The lock is the
    kernel's (flock), so a process that dies releases it."""
    import fcntl

    if _held:
        return
    handle = open(LOCK, "w")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _held.append(handle)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                raise ClusterError(f"another job has held the cluster for {wait_s:g} s ({LOCK})")
            time.sleep(0.5)


def down() -> None:
    """Kill every process inside our namespaces and delete them (veths and bridge go with them),
    then let another job have the cluster."""
    try:
        _remove_hosts()
    finally:
        while _held:
            _held.pop().close()  # closing the file releases the lock


def _remove_hosts() -> None:
    for ns in namespaces():
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _run("ip", "netns", "del", ns)


def up(hosts: int, rate: str = "1gbit") -> list[str]:
    """Make `hosts` hosts on one switch, each link limited to `rate` each way; return their addresses.

    All or nothing: on any error (or Ctrl-C) everything made so far is removed again."""
    reason = why_not()
    if reason:
        raise ClusterError(reason)
    if not 2 <= hosts <= 16:
        raise ClusterError(f"--hosts must be 2..16, not {hosts}")
    _take_the_cluster()
    _remove_hosts()  # a fresh start: leftovers of an interrupted run would collide
    try:
        _run("ip", "netns", "add", SWITCH)
        _run("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", SWITCH, "link", "set", "br0", "up")
        for i in range(hosts):
            _add_host(i, rate)
    except BaseException:
        down()
        raise
    return [address(i) for i in range(hosts)]


def _add_host(i: int, rate: str) -> None:
    ns, port = host(i), f"port{i}"
    _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", SWITCH)
    _run("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
    for cmd in (["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                ["ip", "-n", SWITCH, "link", "set", port, "master", "br0"],
                ["ip", "-n", SWITCH, "link", "set", port, "up"]):
        _run(*cmd)
    # tbf shapes what leaves an interface: on eth0 the host's upload, on the switch port its download.
    # A 20 ms queue, like a switch port's buffer (jumbo frames and other queue lengths, from 5 to
    # 100 ms, measured the same here within the noise).
    shape = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "20ms"]
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *shape)
    _run("ip", "netns", "exec", SWITCH, "tc", "qdisc", "add", "dev", port, *shape)


def node_command(i: int, script: str | Path, hosts: int, nproc_per_host: int, *args: str, c10d: bool = False,
                 max_restarts: int = 0) -> list[str]:
    """Host i's part of a job: torchrun inside its namespace, node rank i, the rendezvous at host 0.
    Static (--master-addr) by default; c10d=True for an elastic job that can restart its ranks."""
    at = f"{address(0)}:{PORT}"
    if c10d:  # every namespace has the machine's host name: say which host serves the rendezvous
        rendezvous = dict(rdzv_endpoint=at, run_id="cluster", options=(
            f"--rdzv-conf=is_host={'true' if i == 0 else 'false'}", f"--local-addr={address(i)}"))
    else:
        rendezvous = dict(master=at)
    return ["ip", "netns", "exec", host(i), *torchrun_command(
        script, nproc_per_host, *args, all_ranks=True, nnodes=hosts, node_rank=i, max_restarts=max_restarts,
        **rendezvous)]


def run_bench(script: str | Path, hosts: int, rate: str, args: list, name: str, timeout: float = 900,
              nproc_per_host: int = 1) -> int:
    """A bench's measurement: build `hosts` hosts with `rate` links, run `script` on them as one job,
    take the cluster down whatever happened, and print each host's output. 0 when every host
    succeeded; else 1, with the cluster's error or the failed host's stderr on stderr."""
    try:
        up(hosts, rate)
        try:
            results = run_job(Path(script), hosts, *map(str, args), nproc_per_host=nproc_per_host, timeout=timeout)
        finally:
            down()
    except ClusterError as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    for i, r in enumerate(results):
        print(r.stdout, end="")
        if r.returncode != 0:
            print(f"host {i} failed (exit {r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
    return 0


def run_job(script: str | Path, hosts: int, *args: str, nproc_per_host: int = 1, timeout: float = 180,
            env: dict[str, str] | None = None, c10d: bool = False,
            max_restarts: int = 0) -> list[subprocess.CompletedProcess]:
    """Run `script` as one multi-node job, one torchrun per host (ringside.launch.torchrun_nodes);
    each host's result, in host order. Every process is killed if the job outlasts `timeout`."""
    present = set(namespaces())
    missing = [host(i) for i in range(hosts) if host(i) not in present]
    if missing:
        raise ClusterError(f"no cluster host {', '.join(missing)}: run `make cluster N={hosts}` first")
    commands = [node_command(i, script, hosts, nproc_per_host, *args, c10d=c10d, max_restarts=max_restarts)
                for i in range(hosts)]
    try:  # gloo must talk over the shaped link
        return torchrun_nodes(commands, timeout, env={"GLOO_SOCKET_IFNAME": "eth0", **(env or {})})
    except subprocess.TimeoutExpired:
        raise ClusterError(f"the job on {hosts} hosts was still running after {timeout:g} s and was killed") from None


def bench(rate: str, sizes_mib: str, host_counts: tuple[int, ...] = (2, 3, 4)) -> int:
    """Chapter 04's measurement: bring up each cluster, run the all-reduce bench, take it down."""
    from . import cluster_bench

    ring.CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    for hosts in host_counts:
        up(hosts, rate)
        try:
            print(f"-- {hosts} hosts, {rate} links")
            results = run_job(Path(cluster_bench.__file__), hosts, "--sizes-mib", sizes_mib, "--rate", rate,
                              "--out", str(ring.CLUSTER_DIR / f"allreduce_{hosts}hosts.json"), timeout=540)
        finally:
            down()
        for i, r in enumerate(results):
            print(r.stdout, end="")
            if r.returncode != 0:
                print(f"host {i} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                return 1
    ring.plot_cluster(ring.load_cluster_results(), ring.CLUSTER_DIR / "allreduce.png")
    print(f"wrote {ring.CLUSTER_DIR.relative_to(ROOT)}/")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="make the hosts")
    p_up.add_argument("--hosts", type=int, default=4)
    p_up.add_argument("--rate", default="1gbit", help="each link's rate, each way (tc syntax: 1gbit, 100mbit)")
    sub.add_parser("down", help="remove every host and the switch")
    sub.add_parser("status", help="list the hosts")
    p_bench = sub.add_parser("bench", help="measure on 2 and 4 hosts; write assets/cluster/")
    p_bench.add_argument("--rate", default="1gbit")
    p_bench.add_argument("--sizes-mib", default="1,4,16,64")
    p_bench.add_argument("--hosts", default="2,3,4", help="comma-separated host counts to measure")
    p_run = sub.add_parser("run", help="run a script with torchrun on every host")
    p_run.add_argument("--hosts", type=int, default=4)
    p_run.add_argument("--timeout", type=float, default=300)
    p_run.add_argument("script")
    p_run.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` cleans up like Ctrl-C does
    try:
        if opts.command == "up":
            addresses = up(opts.hosts, opts.rate)
            print(f"cluster up: {opts.hosts} hosts ({', '.join(addresses)}), links {opts.rate} each way; "
                  f"`make cluster-down` removes it")
        elif opts.command == "down":
            reason = why_not()
            if reason:
                raise ClusterError(reason)
            down()
            print("cluster down: no host left")
        elif opts.command == "bench":
            return bench(opts.rate, opts.sizes_mib, tuple(int(h) for h in opts.hosts.split(",")))
        elif opts.command == "status":
            print("\n".join(namespaces()) or "no cluster")
        else:
            failed = False
            for i, r in enumerate(run_job(opts.script, opts.hosts, *opts.args, timeout=opts.timeout)):
                print(r.stdout, end="")
                if r.returncode != 0:
                    failed = True
                    print(f"host {i} failed (exit {r.returncode}):\n{r.stderr[-2000:]}", file=sys.stderr)
            return 1 if failed else 0
    except ClusterError as error:
        print(f"cluster: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
