"""The check of lab 15 (hierarchy): it runs the code of labs/15_hierarchy.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import math
import re
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder, lab_namespaces
from ringside.effects import never_waited, on_rank_gpu
from ringside.lab import known_cause, ranks_count

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()

# --- The layout, a pure function ------------------------------------------------------------------


def expected_layout(world_size: int, per_host: int) -> tuple[list[list[int]], list[list[int]]]:
    hosts = [list(range(h * per_host, (h + 1) * per_host)) for h in range(world_size // per_host)]
    return hosts, [list(range(i, world_size, per_host)) for i in range(per_host)]


def check_layout(checks: Checks) -> bool:
    """host_layout alone, on 1-4 hosts x 1-3 ranks per host, and on sizes that are no whole hosts."""
    for hosts_n in range(1, 5):
        for per_host in range(1, 4):
            world = hosts_n * per_host
            call = f"host_layout({world}, {per_host})"
            try:
                got = lab.host_layout(world, per_host)
                hosts, peers = [list(map(list, g)) for g in got]
            except NotImplementedError:
                raise
            except Exception as error:
                return checks.expect(False, f"{call} raised {type(error).__name__}: {error}")
            want_hosts, want_peers = expected_layout(world, per_host)
            if (hosts, peers) == (want_hosts, want_peers):
                continue
            seen = f"{call} gave hosts {hosts}, peers {peers}; expected hosts {want_hosts}, peers {want_peers}"
            if (hosts, peers) == (want_peers, want_hosts):
                return checks.expect(False, f"{seen}: hosts and peers are swapped - a host is a block of "
                                            f"consecutive ranks, the peers take one rank from each host")
            if hosts == want_hosts:
                return checks.expect(False, f"{seen}: the hosts are right, the peers are not - peers[i] holds "
                                            f"the ranks with local index i (rank % ranks_per_host == i), one per host")
            if hosts == [list(range(h, world, hosts_n)) for h in range(hosts_n)]:
                return checks.expect(False, f"{seen}: your hosts take one rank in every {hosts_n} - torchrun numbers "
                                            f"the ranks host by host, so host h holds consecutive ranks "
                                            f"h*L ... h*L + L-1")
            return checks.expect(False, f"{seen}: a rank r sits on host r // ranks_per_host at local index "
                                        f"r % ranks_per_host")
    for world, per_host in ((5, 2), (4, 3)):
        try:
            got = lab.host_layout(world, per_host)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as error:
            return checks.expect(False, f"host_layout({world}, {per_host}) raised {type(error).__name__}: "
                                        f"{error} - raise ValueError when the ranks are no whole hosts")
        return checks.expect(False, f"host_layout({world}, {per_host}) returned {got}: {world} ranks are no whole "
                                    f"hosts of {per_host} - raise ValueError instead of a layout with a missing rank")
    return checks.expect(True, "")


# --- make_groups, rehearsed: dist.new_group noted, nothing made -----------------------------------


class Token:
    """What the rehearsed dist.new_group returns: the ranks it was asked for."""

    def __init__(self, ranks, local: bool = False):
        self.ranks = tuple(sorted(ranks))
        self.local = local  # use_local_synchronization=True: only the members need create it

    def __repr__(self):
        return f"group{list(self.ranks)}"


class NotRehearsable(Exception):
    """make_groups went through torch code that the rehearsal cannot play at a world size other than
    the job's (init_device_mesh, say): it is judged by a real call at the job's world size instead."""


def raised_in_learners_code(error: BaseException) -> bool:
    """Whether the innermost frame of the error is in the learner's lab file (its own mistake), not in
    torch's code reached through a name the rehearsal could not stand in for."""
    home = lab.make_groups.__code__.co_filename
    tb, last = error.__traceback__, None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last == home or "/torch/" not in (last or "")


def rehearse_groups(world: int, per_host: int, rank: int) -> tuple[list[Token], object]:
    """make_groups played as `rank` of `world` ranks with new_group noted, not run: the groups it
    asked for, in order, and what it returned. new_group is stood in for wherever its name is bound
    (dist, c10d, and every module that imported it by name)."""
    made: list[Token] = []

    def new_group(ranks=None, *args, **kwargs):
        token = Token(range(world) if ranks is None else ranks, bool(kwargs.get("use_local_synchronization")))
        made.append(token)
        return token

    names = {"new_group": new_group, "get_rank": lambda group=None: rank,
             "get_world_size": lambda group=None: world}
    originals = {name: getattr(c10d, name) for name in names}

    def bound(module, name):  # a module's attribute, None where reading it fails (lazy modules)
        try:
            return getattr(module, name, None)
        except Exception:
            return None
    modules = [dist, c10d] + [m for m in list(sys.modules.values())
                              if m is not None and m not in (dist, c10d)
                              and bound(m, "new_group") is originals["new_group"]]
    saved = [(module, name, getattr(module, name)) for module in modules for name in names
             if module in (dist, c10d) or bound(module, name) is originals[name]]
    for module, name, _ in saved:
        setattr(module, name, names[name])
    try:
        returned = lab.make_groups(world, per_host)
    except NotImplementedError:
        raise
    except Exception as error:
        if not raised_in_learners_code(error):
            raise NotRehearsable(f"{type(error).__name__}: {error}") from error
        raise
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    return made, returned


def created_apart(played: list[tuple[list[Token], object]]) -> str | None:
    """Why the ranks' new_group calls would not meet, or None. A group made with
    use_local_synchronization=True needs only its members; every other group needs every rank. And in
    torch 2.14 a group's name counts the new_group calls each rank made before it (local ones too, as
    the salt of the hashed name), so every rank that makes a group must make it as the same call of
    its sequence: the same groups in the same order, or the same number of calls before each."""
    world = len(played)
    global_lists = [[t.ranks for t in made if not t.local] for made, _ in played]
    differ = next((r for r in range(world) if global_lists[r] != global_lists[0]), None)
    if differ is not None:
        return (f"rank 0 created {global_lists[0]}, rank {differ} created {global_lists[differ]}: dist.new_group is "
                f"collective - every rank must create every group, in the same order, even those it is not in "
                f"(else the job hangs; with use_local_synchronization=True only the group's members)")
    position: dict[tuple, dict[int, int]] = {}  # group -> {rank: its place in that rank's calls}
    for rank, (made, _) in enumerate(played):
        for place, token in enumerate(made):
            position.setdefault((token.ranks, token.local), {}).setdefault(rank, place)
    for (group, local), places in position.items():
        needed = [r for r in group if r < world] if local else list(range(world))
        absent = [r for r in needed if r not in places]
        if absent:
            return (f"rank(s) {absent} never created the group {list(group)} they belong to (made with "
                    f"use_local_synchronization=True): every member must create it, or the others wait for ever")
        if len({places[r] for r in needed}) > 1:
            a, b = sorted(needed, key=lambda r: places[r])[::len(needed) - 1]
            return (f"rank {a} created the group {list(group)} as its new_group call {places[a] + 1}, rank {b} as "
                    f"its call {places[b] + 1}: a group's name counts the new_group calls made before it "
                    f"(use_local_synchronization=True too), so the two wait under different names - make the "
                    f"same number of new_group calls on every rank before each group (the same order)")
    return None


def made_groups(played: list[tuple[list[Token], object]]) -> list[tuple]:
    """The groups created, each once: the common ones as rank 0 made them, then the local ones."""
    made = [t.ranks for t in played[0][0] if not t.local]
    for rank_made, _ in played:
        for t in rank_made:
            if t.local and t.ranks not in made:
                made.append(t.ranks)
    return made


def check_groups(checks: Checks) -> bool:
    for world, per_host in ((6, 3), (6, 2), (8, 2), (4, 1)):
        hosts, peers = expected_layout(world, per_host)
        wanted = sorted(tuple(g) for g in hosts + peers)
        played = []
        for rank in range(world):
            try:
                played.append(rehearse_groups(world, per_host, rank))
            except NotImplementedError:
                raise
            except NotRehearsable:
                return check_groups_for_real(checks)
            except Exception as error:
                hint = (" - did you index the groups with the wrong number? (host: rank // ranks_per_host, peers: "
                        "rank % ranks_per_host)" if isinstance(error, IndexError) else "")
                return checks.expect(False, f"make_groups({world}, {per_host}) played as rank {rank} raised "
                                            f"{type(error).__name__}: {error}{hint}")
        call = f"make_groups({world}, {per_host}) (rehearsed on every rank: new_group noted, nothing made)"
        apart = created_apart(played)
        if apart is not None:
            return checks.expect(False, f"{call}: {apart}")
        made = made_groups(played)
        missing = [list(g) for g in wanted if g not in made]
        if missing:
            return checks.expect(False, f"{call} created {made}: no group for {missing} - one group per host "
                                        f"and one per set of peers")
        if len(made) != len(wanted):
            return checks.expect(False, f"{call} created {len(made)} groups, not {len(wanted)}: one per host "
                                        f"and one per set of peers, each once")
        for rank, (_, returned) in enumerate(played):
            try:
                got = [g.ranks if isinstance(g, Token) else g for g in returned]
            except TypeError:
                got = returned
            if (wrong := returned_wrong(call, rank, world, per_host, got, returned)) is not None:
                return checks.expect(False, wrong)
    return checks.expect(True, "")


def returned_wrong(call: str, rank: int, world: int, per_host: int, got, returned) -> str | None:
    """What is wrong with the groups make_groups returned on `rank` (`got`: their ranks), or None."""
    hosts, peers = expected_layout(world, per_host)
    my_host, my_peers = tuple(hosts[rank // per_host]), tuple(peers[rank % per_host])
    if got == [my_host, my_peers]:
        return None
    where = f"{call}, on rank {rank},"
    if got == [my_peers, my_host]:
        return f"{where} returned (its peers' group, its host's group): swapped - return (host group, peers group)"
    return (f"{where} returned {returned}; expected the groups of its host {list(my_host)} and of its peers "
            f"{list(my_peers)} - did you keep the last group created, or index the groups with the wrong number?")


def check_groups_for_real(checks: Checks) -> bool:
    """make_groups called for real at the job's world size, for every number of ranks per host that
    divides it (every rank calls it, as the contract says): the groups it returns, by their ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for per_host in [n for n in range(1, world + 1) if world % n == 0]:
        call = f"make_groups({world}, {per_host}) (called for real: it cannot be rehearsed at other world sizes)"
        try:
            returned = lab.make_groups(world, per_host)
            got = [tuple(sorted(dist.get_process_group_ranks(g))) for g in returned]
        except NotImplementedError:
            raise
        except Exception as error:
            return checks.expect(False, f"{call} raised {type(error).__name__}: {error}")
        if not checks.agree(returned_wrong(call, rank, world, per_host, got, returned)):
            return False
    return True


# --- The all-reduce, for real, with every collective noted -----------------------------------------

SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")


class Noted(Exception):
    """A collective that the check refused to run (it would hang or mislead): the diagnosis."""


def collective_log(host_group, peer_group) -> Recorder:
    """The recorder of the learner's collectives (ringside.calls): each call also notes its
    "level", the group it ran on - "host" or "peers" (that group, or one of the same ranks), else
    refused at once with a diagnosis, since it could hang: the contract says "collectives only on
    these two groups, never on the default group"."""
    levels = [(host_group, "host", tuple(dist.get_process_group_ranks(host_group))),
              (peer_group, "peers", tuple(dist.get_process_group_ranks(peer_group)))]

    def on_call(call):
        level = next((name for group, name, _ in levels if call.group is group), None) or \
            next((name for _, name, ranks in levels if call.group is not None and call.group_ranks == ranks), None)
        call["level"] = level or ("default" if call.default_group else "other")
        if call["level"] == "default":
            raise Noted(f"dist.{call.op} ran on the default group (all ranks): the two levels must use "
                        f"host_group (inside a host) and peer_group (across hosts) only - pass group=...")
        if call["level"] == "other":
            raise Noted(f"dist.{call.op} ran on a group other than host_group and peer_group: use the two "
                        f"groups you are given")

    return Recorder(namespaces=lab_namespaces(lab), on_call=on_call)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def unfinished(log) -> str:
    """Completion, an effect however it was waited for: a collective not finished when the function
    returned, or one that read a tensor an earlier collective was still writing. "" if neither."""
    calls = [c for c in log.calls if "level" in c]
    for c in calls:
        for earlier in (log.calls[i] for i in c.pending):
            written = [ref() for ref in earlier.outputs if ref() is not None]
            if any(overlaps(w, t) for w in written for t in c.tensors):
                return (f"dist.{c.op} started on a tensor that dist.{earlier.op} (async_op=True) was still writing: "
                        f"wait on the first one before the next level uses its result")
    late = [c.op for c in calls if not c.completed]
    if late:
        return (f"dist.{late[0]} ran with async_op=True and had not been waited on when hierarchical_all_reduce "
                f"returned: wait on it before its result is used")
    return ""


def example(rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's input: (r + 1) * 1000 + (i % 97): every partial sum tells whose values it holds."""
    return ((rank + 1) * 1000 + torch.arange(math.prod(shape)) % 97).to(dtype).reshape(shape)


def layouts(world: int) -> list[tuple[int, int]]:
    """(hosts, ranks per host) for 1-4 hosts x 1-3 ranks that fit, the most telling first."""
    fits = [(h, l) for h in range(1, 5) for l in range(1, 4) if h * l <= world]
    return sorted(fits, key=lambda hl: (-(hl[0] > 1 and hl[1] > 1), -hl[1], -hl[0]))


def cases(per_host: int) -> list[tuple[tuple, torch.dtype]]:
    return [((per_host * 4,), torch.float32), ((per_host * 4 + 1,), torch.float64), ((3, 5), torch.int64),
            ((1,), torch.float32)]


def diagnose_values(result, returned, mine, rank, hosts_n, per_host, shape, dtype, log) -> str:
    """Why this rank's result is wrong: the plausible wrong answers, recomputed and named."""
    world = hosts_n * per_host
    host = rank // per_host
    full = sum(example(r, shape, dtype).double() for r in range(world))
    got = result.double().cpu()  # the expected values are built on the CPU; under nccl the result is on the GPU
    where = (f"{hosts_n} hosts x {per_host} ranks, {tuple(shape)} {str(dtype).replace('torch.', '')}: rank {rank}'s "
             f"result")
    if returned is not None and isinstance(returned, torch.Tensor) and returned.shape == result.shape and \
            torch.equal(returned.double().cpu(), full) and not torch.equal(got, full):
        return (f"{where}: the returned tensor holds the sum but `tensor` itself does not - the caller keeps "
                f"`tensor`: copy the sum into it (in place), without the padding")
    names = [c.op for c in log.calls]
    if late := unfinished(log):
        return f"{where} is wrong and {late}"
    if swapped(log):
        return (f"{where} is wrong and your collectives ran as {names} with the groups swapped: the reduce-scatter "
                f"and the all-gather belong inside the host (host_group), the all-reduce across hosts (peer_group)")
    host_sum = sum(example(r, shape, dtype).double() for r in range(host * per_host, (host + 1) * per_host))
    across = any(c.op == "all_reduce" and c["level"] == "peers" for c in log.calls)
    if hosts_n > 1 and torch.equal(got, host_sum):
        return (f"{where} is the sum over its own host only: the all-reduce across hosts (over peer_group) is "
                + ("missing" if not across else "there, but its result did not reach `tensor`"))
    if torch.equal(got, mine.double()):
        if not any(c.op in GATHERS for c in log.calls):
            return (f"{where} is unchanged: the all-gather inside the host is missing - without it the summed "
                    f"shards never come back together")
        return (f"{where} is unchanged although your collectives ran ({names}): the sum never reached `tensor` - "
                f"copy it back into `tensor` itself (in place), without the padding")
    if hosts_n > 1 and torch.allclose(got, full / hosts_n):
        return f"{where} is the sum divided by the number of hosts: a sum must not average (ReduceOp.SUM, not AVG)"
    if world > 1 and torch.allclose(got, full / world):
        return f"{where} is the mean, not the sum: hierarchical_all_reduce sums; averaging is the caller's job"
    flat_got, flat_full = got.reshape(-1), full.reshape(-1)
    shard = -(-flat_got.numel() // per_host)
    right = [i for i in range(per_host) if torch.equal(flat_got[i * shard:(i + 1) * shard], flat_full[i * shard:(i + 1) * shard])]
    local = rank % per_host
    if per_host > 1 and right == [local]:
        return (f"{where} is right only in its own shard ({local} of {per_host}): the all-gather inside the host "
                f"(or the copy of its result into `tensor`) is missing")
    if per_host > 1 and torch.equal(flat_got, flat_full * per_host) is False and \
            torch.allclose(flat_got, flat_full * per_host):
        return f"{where} is {per_host}x the sum: the host's sum was counted once per rank of the host"
    padded = torch.cat([flat_full, flat_full.new_zeros(shard * per_host - flat_full.numel())])
    if per_host > 1 and padded.numel() > flat_full.numel() and torch.equal(flat_got, padded[-flat_full.numel():]):
        return (f"{where} is the sum shifted by the padding: the zeros pad the END of the buffer, so the sum is its "
                f"first {flat_full.numel()} elements - copy padded[:numel] back, not its last ones")
    wrong = int((flat_got != flat_full).sum())
    return (f"{where} differs from dist.all_reduce in {wrong} of {flat_got.numel()} elements (shards right: "
            f"{right or 'none'}); collectives called: {names}")


def swapped(log) -> bool:
    """The reduce-scatter or all-gather ran across hosts, the all-reduce inside the host."""
    return any(c.op in SCATTERS + GATHERS and c["level"] == "peers" for c in log.calls) and \
        any(c.op == "all_reduce" and c["level"] == "host" for c in log.calls)


RING_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def sent(log, level: str, ranks: int) -> float:
    """Elements each rank sends on one level, every collective run as a ring over `ranks` ranks:
    an all-reduce sends 2(n-1)/n of its tensor, a reduce-scatter or all-gather (n-1)/n of the whole."""
    return sum(RING_SHARE.get(c.family, lambda n: float(n > 1))(ranks) * max(c.numel, c.out_numel)
               for c in log.calls if c.get("level") == level)


def diagnose_traffic(log, hosts_n, per_host, numel, where) -> str:
    """Right sum; now the communication, an effect counted by the recorder: the elements each rank
    sends across hosts and inside its host, against the reference (a reduce-scatter and an
    all-gather of the smallest padded buffer inside the host, an all-reduce of one shard across),
    and whether every collective had finished. The cause is named only after that."""
    share = -(-numel // per_host)
    across, inside = sent(log, "peers", hosts_n), sent(log, "host", per_host)
    want_across, want_inside = 2 * (hosts_n - 1) / hosts_n * share, 2 * (per_host - 1) / per_host * share * per_host
    if across > want_across + 1e-9:
        if swapped(log) or any(c.op in SCATTERS + GATHERS and c["level"] == "peers" for c in log.calls):
            return (f"{where}: the sum is right, but the groups are swapped ({[(c.op, c['level']) for c in log.calls]}): "
                    f"the reduce-scatter and the all-gather belong inside the host (host_group), the all-reduce "
                    f"across hosts (peer_group) - with as many hosts as ranks per host the sum comes out right anyway")
        elements = sum(c.numel for c in log.calls if c["level"] == "peers")
        if elements > share + per_host:
            return (f"{where}: the sum is right, but each rank sent {elements} elements across hosts where its shard "
                    f"is {share} ({per_host}x the slow link's traffic): reduce-scatter inside the host first and "
                    f"all-reduce only your shard over peer_group")
        divides = numel % per_host == 0
        return (f"{where}: the sum is right, but each rank sent {elements} elements across hosts where its shard is "
                f"{share}: the padding is longer than it must be ({numel} elements "
                f"{'already divide' if divides else 'need ' + str(share * per_host - numel) + ' zero(s) to divide'} "
                f"by {per_host} ranks per host) - pad to the smallest multiple of the ranks per host, and not at "
                f"all when the size divides")
    if inside > want_inside + 1e-9:
        if any(c.op == "all_reduce" and c["level"] == "host" for c in log.calls):
            return (f"{where}: the sum is right, but an all-reduce ran inside the host, which sends twice what a "
                    f"reduce-scatter sends: reduce-scatter (each rank keeps one summed shard), then all-gather at "
                    f"the end")
        return (f"{where}: the sum is right, but each rank sent {inside:.0f} elements inside its host where a "
                f"reduce-scatter and an all-gather of the padded buffer send {want_inside:.0f}")
    if late := unfinished(log):
        return f"{where}: the sum is right here, but {late}"
    return ""


def raised_diagnosis(error: Exception, log, where: str, numel: int, per_host: int) -> str:
    """Why hierarchical_all_reduce raised: groups swapped, ReduceOp.AVG, a size that does not divide, or
    PyTorch's own words (with what they mean here)."""
    raised = f"{where} raised {type(error).__name__}"
    if swapped(log) or any(c.op in SCATTERS and c["level"] == "peers" for c in log.calls):
        log.calls.clear()  # nothing of it is waited for afterwards
        return (f"{raised} after a reduce-scatter over peer_group: the groups are swapped - the reduce-scatter and "
                f"the all-gather belong inside the host (host_group), the all-reduce across hosts (peer_group)")
    if any(c.reduce_op == dist.ReduceOp.AVG for c in log.calls):
        return (f"{raised} with ReduceOp.AVG: an average is the sum divided by the number of hosts (and gloo cannot "
                f"average integers) - a sum must not average (ReduceOp.SUM)")
    words = ("size", "shape", "numel", "match", "divisible", "expand")
    uneven = per_host > 1 and numel % per_host and any(word in str(error).lower() for word in words)
    first = re.sub(r"^(\[rank\d+\]:)?\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])
    cause = known_cause(error)
    return f"{raised}: {first[:160]}" + (
        f" - {numel} elements do not divide by {per_host} ranks per host: pad to a multiple (zeros), and drop "
        f"the padding at the end" if uneven else f" - {cause}" if cause else "")


def check_all_reduce(checks: Checks, group, device: torch.device) -> bool:
    """Against dist.all_reduce (computed here from every rank's known input) on every layout that fits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tried = 0
    for hosts_n, per_host in layouts(world):
        hosts, peers = expected_layout(hosts_n * per_host, per_host)
        made = {tuple(r): dist.new_group(r) for r in hosts + peers}  # every rank creates every group
        inside = rank < hosts_n * per_host
        for shape, dtype in cases(per_host):
            why = ""
            if inside:
                host_group, peer_group = made[tuple(hosts[rank // per_host])], made[tuple(peers[rank % per_host])]
                mine = example(rank, shape, dtype)
                tensor = mine.to(device, copy=True)  # a copy (on the rank's GPU under nccl): `mine` stays the input
                where = f"hierarchical_all_reduce on {hosts_n} hosts x {per_host} ranks, {tuple(shape)} " \
                        f"{str(dtype).replace('torch.', '')}"
                returned = None
                with collective_log(host_group, peer_group) as log:
                    try:
                        returned = lab.hierarchical_all_reduce(tensor, host_group, peer_group)
                    except NotImplementedError:
                        raise
                    except Noted as noted:
                        why = f"{where}: {noted}"
                    except Exception as error:
                        why = raised_diagnosis(error, log, where, tensor.numel(), per_host)
                for call in never_waited(log.calls):  # finished here, the record unchanged
                    if call.get("work") is not None:
                        call.work.wait()
                if not why:
                    returned_itself = returned is tensor
                    tensor = tensor.cpu()  # compared on the CPU, with the sum computed here
                    returned = returned.cpu() if isinstance(returned, torch.Tensor) else returned
                    full = sum(example(r, shape, dtype) for r in range(hosts_n * per_host))
                    if tensor.dtype != dtype or tensor.shape != mine.shape:
                        why = f"{where}: `tensor` changed its dtype or shape"
                    elif not torch.equal(tensor, full):
                        why = diagnose_values(tensor, returned, mine, rank, hosts_n, per_host, shape, dtype, log)
                    elif not returned_itself:
                        why = f"{where}: the sum is in `tensor`, but the function returned something else - return `tensor`"
                    else:
                        why = diagnose_traffic(log, hosts_n, per_host, tensor.numel(), where)
            if not checks.agree(why or None, group):  # the first rank's words on every rank: one line
                return False
            tried += 1
    shown = len(layouts(world))
    traffic = (" and sends only its shard across hosts" if any(h > 1 and l > 1 for h, l in layouts(world))
               else "")  # with one rank per host, or one host, there is no shard to send
    print0(f"hierarchical_all_reduce equals dist.all_reduce on {tried} cases ({shown} layout{'s' * (shown > 1)} of "
           f"hosts x ranks per host, uneven sizes included){traffic}")
    return True


def check_on_gpu(checks: Checks, group) -> bool:
    """hierarchical_all_reduce run again as on a GPU machine (ringside.effects.on_rank_gpu), on the first
    layout with several ranks per host (or the first): every buffer it hands a collective must be on this
    rank's GPU, as NCCL requires, and the sum comes back there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts_n, per_host = layouts(world)[0]
    hosts, peers = expected_layout(hosts_n * per_host, per_host)
    made = {tuple(r): dist.new_group(r) for r in hosts + peers}  # every rank creates every group
    problem = note = None
    if rank < hosts_n * per_host:
        host_group, peer_group = made[tuple(hosts[rank // per_host])], made[tuple(peers[rank % per_host])]
        problem, note = on_rank_gpu("hierarchical_all_reduce", lambda device: lab.hierarchical_all_reduce(
            example(rank, (per_host * 4 + 1,), torch.float32).to(device), host_group, peer_group),
            lab.hierarchical_all_reduce)
    if note:
        print0(note)
    return checks.agree(problem, group)


def check_training(checks: Checks, per_host: int, device: torch.device) -> None:
    world = dist.get_world_size()
    groups = lab.make_groups(world, per_host)
    theirs = lab.train(device, None).cpu()
    ours = lab.train(device, groups).cpu()
    # Tolerance: the hook divides, then sums in another order than DDP: float32 rounding, about 1e-7
    # per step over a handful of steps; a mistake moves weights by far more than 1e-5.
    gap = (ours - theirs).abs().max().item()
    if checks.expect(gap <= 1e-5, f"DDP with your all-reduce as its communication hook ends {gap:.2e} away from "
                                  f"plain DDP's weights (tolerance 1e-5) on {world // per_host} hosts x {per_host} "
                                  f"ranks: make_groups must return this rank's own host and peers groups"):
        hosts_n = world // per_host
        print0(f"DDP with hierarchical_all_reduce as its hook trains like DDP ({hosts_n} host(s) x {per_host} "
               f"rank(s)); sent out of each host per all-reduce of S bytes: {2 * (hosts_n - 1) / hosts_n:.2f} x S "
               f"(a flat ring: {2 * (world - 1) / world if hosts_n > 1 else 0:.2f} x S)")


def main(me: Rank, checks: Checks) -> None:
    if me.world_size < 4:
        print0("note: with fewer than 4 ranks no layout has both several hosts and several ranks per host, "
               "so the traffic across hosts is not checked: run on 4 ranks too")
    per_host = lab.ranks_per_host(me.world_size)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))  # the check's own messages
    if check_layout(checks) and check_groups(checks) and check_all_reduce(checks, group, me.device) and \
            check_on_gpu(checks, group):
        check_training(checks, per_host, me.device)


def hosts_do_not_divide(world_size: int) -> str | None:
    """--ranks-per-host must cut the ranks into whole hosts (the lab's training uses that layout)."""
    per_host = lab.ranks_per_host(world_size)
    if per_host < 1 or world_size % per_host:
        fits = [n for n in range(1, world_size + 1) if world_size % n == 0]
        return (f"--ranks-per-host {per_host} does not cut {ranks_count(world_size)} into whole hosts: use "
                f"--ranks-per-host {' or '.join(map(str, fits))}, or --nproc-per-node a multiple of {per_host}")
    return None


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    # A short collective timeout: a collective that another rank never joins fails after 15 s.
    run_lab(main, title="Lab 15 (hierarchy)", refuse=hosts_do_not_divide, timeout=timedelta(seconds=15))
