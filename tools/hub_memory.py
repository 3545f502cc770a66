"""Where a workshop room's memory goes: each learner's processes by kind, with their RSS, PSS and
shared pages, and the peak of each learner's cgroup.

    python -m tools.hub_memory            (root, while `make hub` runs: the room now, one table)

`make hub-test` samples the room this way every few seconds while the learners work (Sampler) and
writes the peaks to runs/hub/memory.txt, which docs/INSTRUCTORS.md quotes.

RSS counts every page a process maps, shared or not, so the RSS of forked ranks adds up to far more
than they use; PSS divides each shared page among the processes that map it, so PSS adds up to what
the room really takes. Kinds, by command line: the learner's JupyterLab (the single-user server), a
notebook's kernel, the kernel's rank starter and the ranks it forks, `make lab`'s `python -m
ringside` and the ranks it forks, torchrun and the ranks it starts, and the rest (shells, make).
"""

from __future__ import annotations

import pwd
import threading
from collections import defaultdict
from pathlib import Path

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
MB = 2**20


def smaps(pid: int) -> dict[str, int]:
    """Rss, Pss and shared pages of one process, in bytes (empty when it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return {"rss": out.get("Rss", 0), "pss": out.get("Pss", 0),
            "shared": out.get("Shared_Clean", 0) + out.get("Shared_Dirty", 0)}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def kind(pid: int) -> str:
    """What this process is, in the room's words (see the module's docstring)."""
    cmd = cmdline(pid)
    forked = cmd and cmdline(parent(pid)) == cmd  # a fork keeps its parent's command line
    if "singleuser" in cmd:
        return "JupyterLab server"
    if "ipykernel" in cmd:
        return "kernel: forked rank" if forked else "kernel"
    if "ringside.launch import _serve" in cmd:
        return "rank starter: forked rank" if forked else "rank starter"
    if "-m ringside" in cmd:
        return "make lab: forked rank" if forked else "make lab (python -m ringside)"
    if "torch.distributed.run" in cmd:
        return "torchrun" if not forked else "torchrun: forked rank"
    if "torch.distributed.run" in cmdline(parent(pid)):
        return "torchrun: started rank"  # a fresh process that imports torch itself
    if "python" in cmd:  # named by what it runs, e.g. "-m tools.progress"
        return "other: " + " ".join(Path(a).name for a in cmd.split()[1:3])
    return "other (shells, make)"


def learner_pids(logins: list[str]) -> dict[str, list[int]]:
    """Each learner's processes, by their user (wherever they run: the hub's cgroups or a Slurm job's)."""
    uids = {}
    for login in logins:
        try:
            uids[pwd.getpwnam(login).pw_uid] = login
        except KeyError:
            pass
    pids: dict[str, list[int]] = {login: [] for login in uids.values()}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
            except OSError:
                continue
            if uid in uids:
                pids[uids[uid]].append(int(entry.name))
    return pids


def cgroup_bytes(cgroup_name: str, login: str, name: str) -> int:
    try:
        return int((CGROUP_MEMORY / cgroup_name / login / f"memory.{name}").read_text())
    except (OSError, ValueError):
        return 0


def room_now(logins: list[str]) -> dict[str, dict[str, dict]]:
    """learner -> kind -> {n, rss, pss, shared, max_rss, max_pss}: one look at the room."""
    now: dict[str, dict[str, dict]] = {}
    for login, pids in learner_pids(logins).items():
        kinds: dict[str, dict] = defaultdict(lambda: dict(n=0, rss=0, pss=0, shared=0, max_rss=0, max_pss=0))
        for pid in pids:
            m = smaps(pid)
            if not m:
                continue
            k = kinds[kind(pid)]
            k["n"] += 1
            for key in ("rss", "pss", "shared"):
                k[key] += m[key]
            k["max_rss"], k["max_pss"] = max(k["max_rss"], m["rss"]), max(k["max_pss"], m["pss"])
        now[login] = dict(kinds)
    return now


OUTSIDE = {"the browsers (on the learners' laptops in a real room)": "chromium",
           "JupyterHub": "bin/jupyterhub ", "its proxy": "configurable-http-proxy"}


def outside_now() -> dict[str, int]:
    """PSS of what runs outside the learners' cgroups: the hub, its proxy, the test's browsers."""
    pss = dict.fromkeys(OUTSIDE, 0)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmd = cmdline(int(entry.name))
            for name, marker in OUTSIDE.items():
                if marker in cmd:
                    pss[name] += smaps(int(entry.name)).get("pss", 0)
                    break
    return pss


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Looks at the room every `every` seconds in a thread; keeps each kind's peak over learners and
    time, each learner's cgroup peak, and the machine's least available memory."""

    def __init__(self, logins: list[str], cgroup_name: str, every: float = 3.0):
        self.logins, self.cgroup_name, self.every = logins, cgroup_name, every
        self.kinds: dict[str, dict] = {}
        self.learner_pss: dict[str, int] = {}
        self.outside: dict[str, int] = {}
        self.least_available = available()
        self.total = available()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        self.least_available = min(self.least_available, available())
        for name, pss in outside_now().items():
            self.outside[name] = max(self.outside.get(name, 0), pss)
        for login, kinds in room_now(self.logins).items():
            self.learner_pss[login] = max(self.learner_pss.get(login, 0), sum(k["pss"] for k in kinds.values()))
            for name, k in kinds.items():
                peak = self.kinds.setdefault(name, dict(n=0, rss=0, pss=0, shared=0, max_rss=0, max_pss=0))
                for key in peak:
                    peak[key] = max(peak[key], k[key])
        self.samples += 1

    def report(self) -> str:
        peaks = {login: cgroup_bytes(self.cgroup_name, login, "max_usage_in_bytes") for login in self.logins}
        lines = [f"Memory of the room, sampled every {self.every:g} s ({self.samples} samples). Per kind of process, "
                 "the most any one learner had at once (n processes; their RSS, PSS, shared pages summed; "
                 "the largest single process):",
                 f"  {'kind':34} {'n':>3} {'RSS MB':>8} {'PSS MB':>8} {'shared MB':>9} {'1 proc RSS':>10} {'1 proc PSS':>10}"]
        for name in sorted(self.kinds):
            k = self.kinds[name]
            lines.append(f"  {name:34} {k['n']:>3} {k['rss'] / MB:>8.0f} {k['pss'] / MB:>8.0f} {k['shared'] / MB:>9.0f} "
                         f"{k['max_rss'] / MB:>10.0f} {k['max_pss'] / MB:>10.0f}")
        pss = sorted(self.learner_pss.values())
        if pss:
            lines.append(f"Each learner's processes at their peak, PSS summed: {pss[0] / MB:.0f}-{pss[-1] / MB:.0f} MB")
        usage = sorted(v for v in peaks.values() if v)
        if usage:
            lines.append(f"Each learner's cgroup peak (memory.max_usage_in_bytes: processes and the page cache "
                         f"they charged): {usage[0] / MB:.0f}-{usage[-1] / MB:.0f} MB")
        lines += [f"Outside the learners' cgroups, at the peak: {name} {pss / MB:.0f} MB PSS" for name, pss in self.outside.items()]
        lines.append(f"The machine: {self.total / 2**30:.1f} GB available at the start, "
                     f"{self.least_available / 2**30:.1f} GB at the least (browsers and the hub included)")
        return "\n".join(lines)


def main() -> int:
    import json

    from tools.hub import state_file
    if not state_file().exists():
        print("no hub is running here (make hub starts one)")
        return 1
    for login, kinds in room_now(json.loads(state_file().read_text())["learners"]).items():
        total = sum(k["pss"] for k in kinds.values())
        print(f"{login}: {total / MB:.0f} MB PSS")
        for name, k in sorted(kinds.items()):
            print(f"  {name:34} {k['n']:>3} processes  RSS {k['rss'] / MB:6.0f} MB  PSS {k['pss'] / MB:6.0f} MB  "
                  f"shared {k['shared'] / MB:6.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
