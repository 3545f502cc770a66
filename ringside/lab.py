"""The self-check every lab ends with.

A lab hands its functions to its check, `checks/labNN.py`, whose `main(me, checks)` runs on every
rank (`me` is the `Rank` it joined the group as) and records what it verified:

    checks.expect(torch.allclose(mine, expected), "gradients are 2x too large - did you divide by world_size?")

`run_lab` starts it under torchrun, turns an unfinished TODO or a crash into a verdict, gathers
every rank's verdicts to rank 0, prints one line per rank and a summary, and exits with the same
status on every rank: 0 only when all ranks pass.
"""

from __future__ import annotations

import hashlib
import io
import json
import linecache
import os
import re
import sys
import time
import traceback
from contextlib import contextmanager, redirect_stdout
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import torch.distributed as dist

from . import progress
from .runtime import DEFAULT_TIMEOUT, finish, flush, identity_from_env, init_distributed, require_torchrun

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class Checks:
    """This rank's verdicts: each failed expectation keeps its diagnosis."""

    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []
        self.steps: dict[str, list[str]] = {}  # diagnosis -> what to look at next (`make hint`)
        self.count = 0

    def expect(self, ok: bool, diagnosis: str, steps: list[str] | tuple[str, ...] = ()) -> bool:
        """Record one check; `diagnosis` says what is wrong and the likely mistake when ok is False.
        `steps` (optional): what to look at next, each one more specific than the one before, for a
        learner stuck on this FAIL: `make hint` gives them one at a time after the run."""
        self.count += 1
        if not ok:
            self.failures.append(diagnosis)
            if steps:
                self.steps[diagnosis] = list(steps)
        return bool(ok)

    def fail(self, diagnosis: str) -> None:
        self.expect(False, diagnosis)

    def settle(self, wrong, diagnose=None) -> bool:
        """One verdict for every rank (every rank calls it: a collective): FAIL when `wrong` is a message on
        any rank. After a FAIL, and only then, `diagnose()` runs on every rank (it may call collectives)
        and may name the cause. `wrong` is a message, or (what was observed, what to look at when the
        diagnosis names nothing)."""
        if everyone(wrong is None):
            return self.expect(True, "")
        named = diagnose() if diagnose is not None else None
        if isinstance(wrong, tuple):
            self.fail(f"{wrong[0]}: {named or wrong[1]}")
        elif wrong:
            self.fail(f"{wrong}{f' ({named})' if named else ''}")
        return False

    def agree(self, wrong: str | None, group=None) -> bool:
        """One verdict and one line for every rank (a collective): FAIL with the first rank's message
        when any rank has one, so the report shows it once."""
        verdicts = [None] * dist.get_world_size(group)
        dist.all_gather_object(verdicts, wrong, group=group)
        first = next((v for v in verdicts if v), None)
        return self.expect(first is None, first or "")

    @property
    def passed(self) -> bool:
        return self.count > 0 and not self.failures


def everyone(ok: bool) -> bool:
    """True when `ok` holds on every rank (a collective: every rank calls it), so that all ranks go on
    to the next check together. The flag travels on the group's device (a GPU under nccl)."""
    import torch
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# PyTorch errors whose words do not say what to change: (words in the message, what it means here)
KNOWN_CAUSES = [
    (("mutually exclusive with shuffle",),
     "a DataLoader with a sampler takes its order from the sampler: drop shuffle=True (DistributedSampler "
     "shuffles, and set_epoch gives each epoch its own order)"),
    (("dtype() == ", "dtype()"),
     "the tensors of one collective must have one dtype: make its buffers with dtype=the input's dtype"),
    (("Expected parameter `tensor` of type torch.Tensor",),
     "collectives take tensors and change them in place: t = torch.tensor([x]), then read t.item()"),
    (("invalid output tensor list",),
     "all_gather fills a list of one tensor per rank: [torch.empty_like(t) for _ in range(world_size)]"),
    (("allgather: invalid tensor size",),
     "an all-gather's output holds world_size pieces, each the size of one rank's input"),
    (("invalid root rank",),
     "src and dst are ranks of the group, 0 to world_size - 1"),
    (("can't be cast to the desired output type Long",),
     "an integer tensor cannot hold a fraction (an average, or an in-place division): sum (ReduceOp.SUM) "
     "and divide into a float tensor"),
]


def known_cause(error: BaseException) -> str | None:
    """What a PyTorch error means for the learner, where its own words do not say it."""
    message = str(error)
    return next((cause for words, cause in KNOWN_CAUSES if all(w in message for w in words)), None)


def explain(error: BaseException) -> str:
    """One line for the learner: the TODO still open, a likely deadlock, or the crash and where."""
    where = _where(error)
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, NotImplementedError):
        return f"unfinished - {_todo_text(error) or text} ({where})"
    message = str(error).lower()
    if "timed out" in message or "timeout" in type(error).__name__.lower():
        return (f"a communication call timed out ({where}): likely a deadlock - a send, recv or "
                f"collective that another rank never matched")
    if "closed by peer" in message:  # a neighbour timed out first and gloo closed its connections
        return (f"a neighbour gave up waiting and closed the connection ({where}): likely a "
                f"deadlock - a send, recv or collective that the other rank never matched")
    cause = known_cause(error)
    return f"{type(error).__name__}: {text} ({where})" + (f" - {cause}" if cause else "")


def _todo_text(error: BaseException) -> str | None:
    """The `# TODO: ...` comment just above the line that raised (a lab's stub points to it)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    above = linecache.getline(frames[-1].filename, frames[-1].lineno - 1).strip()
    return above[2:] if above.startswith("# TODO: ") else None


def _where(error: BaseException) -> str:
    """The innermost frame of the error that lies in a lab or solution file, else the innermost."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown place"
    ours = [f for f in frames if Path(f.filename).parent.name in ("labs", "solutions")]
    frame = (ours or frames)[-1]
    return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"


@contextmanager
def captured_stdout(echo: bool) -> Iterator[io.StringIO]:
    """Collect what is printed inside the block; `echo` also lets it through to the terminal."""
    buffer = io.StringIO()
    if not echo:
        with redirect_stdout(buffer):
            yield buffer
        return

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            buffer.write(text)
            return sys.__stdout__.write(text)

        def flush(self) -> None:
            sys.__stdout__.flush()

    with redirect_stdout(Tee()):
        yield buffer


def report(checks: Checks, title: str, timeout: timedelta = DEFAULT_TIMEOUT) -> int:
    """Gather every rank's verdicts to rank 0, print them in rank order, return the common exit code."""
    try:
        if not dist.is_initialized():  # the lab stopped before it joined the group itself
            init_distributed(timeout)
        # A fresh gloo group: the default one may be broken by a failed or timed-out collective. A
        # rank that failed early waits here for ranks still stuck in a collective until theirs times
        # out (after `timeout`, perhaps twice), so this wait is longer: no verdict is lost.
        group = dist.new_group(backend="gloo", timeout=max(3 * timeout, timedelta(seconds=60)))
        verdicts: list = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (checks.count, checks.failures, checks.steps), group=group)
    except Exception as error:  # no common report is possible: each rank speaks for itself
        print(f"rank {checks.rank}: could not gather the other ranks' results ({error})", flush=True)
        for diagnosis in checks.failures:
            print(f"rank {checks.rank}: FAIL - {diagnosis}", flush=True)
        return EXIT_FAIL
    failing = [r for r, (count, failures, _) in enumerate(verdicts) if failures or count == 0]
    if checks.rank == 0:
        print(f"\n== {title}: self-check on {ranks_count(len(verdicts))} ==")
        lines = verdict_lines([(count, failures) for count, failures, _ in verdicts])
        for line in lines:
            print(line)
        if failing:
            lines.append(f"{len(failing)} of {ranks_count(len(verdicts))} FAIL: fix the first message above and run again.")
            print(lines[-1])
            tell_torchrun(lines)
        else:
            print(pass_line(len(verdicts)))
        flush()
        record_last_run(verdicts)
    return EXIT_FAIL if failing else EXIT_PASS


def tell_torchrun(lines: list[str]) -> None:
    """Under a plain `torchrun`, a failing exit is followed by torchrun's report of the failed
    processes (30 lines and more), which pushes the verdict off the screen. Rank 0 leaves the verdict
    in the error file torchrun gives each process (TORCHELASTIC_ERROR_FILE, the file its @record
    writes), so that the report's last block, "Root Cause", ends with it. Not set under `make lab`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    verdict = "\n".join(["the lab's verdict (printed above too):", *lines])
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"message": {"message": lines[-1], "extraInfo": {
            "py_callstack": verdict, "timestamp": str(int(time.time()) - 1)}}}))  # rank 0's: the first failure
    except OSError:
        pass


def _without_rank(diagnosis: str, rank: int) -> str:
    for prefix in (f"rank {rank}: ", f"rank {rank}, ", f"Rank {rank}: ", f"Rank {rank}, "):
        if diagnosis.startswith(prefix):
            return diagnosis[len(prefix):]
    return diagnosis


def last_run_file(root: Path, chapter: str) -> Path:
    """Where a lab's last verdict is kept for `make hint` (.hints/ is the learner's, never committed)."""
    return root / ".hints" / f"{chapter}.last-run.json"


def record_last_run(verdicts: list[tuple[int, list[str], dict[str, list[str]]]]) -> None:
    """After a run of a learner's lab (labs/NN_*.py, not a solution): keep its first failing
    diagnosis, the ranks that share it, the check's next steps for it and the lab's text hash, so that
    `make hint CH=NN` can go on from that diagnosis, one step each time; a PASS clears it."""
    script = Path(sys.argv[0]).resolve()
    if script.parent.name != "labs" or not script.name[:2].isdigit():
        return
    state = last_run_file(script.parent.parent, script.name[:2])
    first = next(((rank, failures[0] if failures else "no check ran", steps)
                  for rank, (count, failures, steps) in enumerate(verdicts) if failures or count == 0), None)
    # the learner's record (make progress; in a workshop hub, the instructor's table: make room)
    progress.record(script.name[:2], len(verdicts), first is None,
                    "" if first is None else f"rank {first[0]}: {_without_rank(first[1], first[0])}")
    try:
        if first is None:
            state.unlink(missing_ok=True)
            return
        rank, diagnosis, steps = first
        said = _without_rank(diagnosis, rank)
        ranks = [r for r, (count, failures, _) in enumerate(verdicts)
                 if said in [_without_rank(d, r) for d in failures] or (not failures and count == 0 and said == diagnosis)]
        state.parent.mkdir(exist_ok=True)
        state.write_text(json.dumps({
            "lab": script.name, "sha256": hashlib.sha256(script.read_bytes()).hexdigest(),
            "world_size": len(verdicts), "ranks": ranks or [rank], "diagnosis": said,
            "steps": steps.get(diagnosis, []), "shown": 0}, indent=1))
    except OSError:  # a read-only checkout: the verdict stands, only the hint is lost
        pass


def ranks_count(n: int) -> str:
    """1 -> "1 rank"; 4 -> "4 ranks"."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def pass_line(n: int) -> str:
    """The last line of a lab that passed on n ranks ("All 4 ranks PASS.", "The 1 rank PASSES.")."""
    return "The 1 rank PASSES." if n == 1 else f"All {n} ranks PASS."


def ranks_label(ranks: list[int]) -> str:
    """[0] -> "rank 0"; [0, 1, 2, 3] -> "ranks 0-3"; [0, 2] -> "ranks 0, 2"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def verdict_lines(verdicts: list[tuple[int, list[str]]]) -> list[str]:
    """One line per distinct verdict, with the ranks that share it, in order of first appearance:
    "ranks 0-3: FAIL - ..." rather than the same diagnosis four times. A diagnosis that starts by
    naming its own rank loses that prefix (the line names the ranks already)."""
    shared: dict[str, list[int]] = {}
    for rank, (count, failures) in enumerate(verdicts):
        if not failures and count == 0:
            shared.setdefault("FAIL - no check ran", []).append(rank)
        for diagnosis in failures:
            shared.setdefault(f"FAIL - {_without_rank(diagnosis, rank)}", []).append(rank)
        if failures or count == 0:
            continue
        shared.setdefault(f"PASS ({count} checks)", []).append(rank)
    return [f"{ranks_label(ranks)}: {verdict}" for verdict, ranks in _merge_by_one_number(shared)]


NUMBER = re.compile(r"(\d+(?:\.\d+)?)")


def _merge_by_one_number(shared: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    """FAIL lines that differ only in one number become one line: the first rank's diagnosis as it
    is, and what the others had instead ("ranks 1-3: FAIL - expected rank 1's tensor (likewise on
    ranks 2-3, with 2, 3 for 1)") rather than a line per rank."""
    groups: list[tuple[dict[int, list[str]], list[int | None]]] = []  # (rank -> its pieces, [where they differ])
    for verdict, ranks in shared.items():
        pieces = NUMBER.split(verdict)  # text, number, text, number, ..., text
        for by_rank, where in groups if verdict.startswith("FAIL") else ():
            other = next(iter(by_rank.values()))
            if len(pieces) != len(other) or any(pieces[i] != other[i] for i in range(0, len(pieces), 2)):
                continue
            differ = [i for i in range(1, len(pieces), 2) if pieces[i] != other[i]]
            if len(differ) == 1 and where[0] in (None, differ[0]) and not set(ranks) & set(by_rank):
                where[0] = differ[0]
                by_rank.update({rank: pieces for rank in ranks})
                break
        else:
            groups.append(({rank: pieces for rank in ranks}, [None]))
    lines = []
    for by_rank, (where,) in groups:
        first = by_rank[min(by_rank)]
        text = "".join(first)
        if where is not None:
            others = [r for r in sorted(by_rank) if by_rank[r][where] != first[where]]
            text += (f" (likewise on {ranks_label(others)}, with {', '.join(by_rank[r][where] for r in others)} "
                     f"for {first[where]})")
        lines.append((text, sorted(by_rank)))
    return lines


def refusal(title: str, world_size: int, why: str) -> str:
    """The one line a lab prints when it cannot check this world size (tests look for "cannot check")."""
    return f"{title} cannot check {ranks_count(world_size)}: {why}"


REFUSAL_WAIT = timedelta(seconds=60)


def refuse_and_exit(line: str, rank: int, wait: timedelta = REFUSAL_WAIT) -> NoReturn:
    """Rank 0 prints the refusal; no rank exits before it has (REVIEW A: under torchrun, a rank that
    exits with status 2 makes torchrun stop the others, so rank 0 was often stopped before it could
    print). Every rank decides the refusal by itself (same world size, same arguments); rank 0 prints
    first, with no communication before it, then every rank meets at a barrier of a small gloo group
    and only then exits. A rank that cannot reach the others (no group within `wait`) exits anyway:
    rank 0's line is already out by then."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=wait)
        dist.barrier()
    except Exception:  # the line is printed (rank 0) or rank 0 is gone: nothing left to wait for
        pass
    finish(EXIT_USAGE)


def run_lab(
    main: Callable[..., None],
    title: str,
    refuse: Callable[[int], str | None] | None = None,
    init: bool = True,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> NoReturn:
    """Run a lab's main on this rank and exit with the verdict of all ranks.

    init=True (the usual case): run_lab joins the group and calls main(me, checks), `me` being
    this process's Rank. init=False leaves joining the group to the lab (when that is the lesson)
    and calls main(checks). `refuse(world_size)` says why the check cannot tell right from wrong
    at that world size (None where it can): the lab then stops before it starts, with that reason."""
    require_torchrun(sys.argv[0])
    rank, world_size, _ = identity_from_env()
    why = refuse(world_size) if refuse is not None else None
    if why:
        refuse_and_exit(refusal(title, world_size, why), rank)
    checks = Checks(rank)
    try:
        if init:
            main(init_distributed(timeout), checks)
        else:
            main(checks)
    except Exception as error:  # every failure becomes a verdict that rank 0 can report
        checks.fail(explain(error))
        if not isinstance(error, NotImplementedError):
            traceback.print_exc()
    finish(report(checks, title, timeout))
