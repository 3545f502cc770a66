"""Starting processes: the course's one launcher. Every entry point has a time limit.

    run_ranks(fn, world_size)          fn on N ranks joined in one gloo group, from a notebook cell
    fork_processes(fn, n)              fn on N processes with no group (chapter 05: joining is the lesson)
    torchrun_script(script, nproc)     a script under torchrun, from a cell or a test; a failing job fails
    torchrun_nodes(commands)           several torchruns at once, one per node (chapter 05, the cluster)
    fork_script(script, nproc)         a script on N ranks forked by the rank starter (tests' fast path)
    fork_script_ranks(script, ...)     a script's ranks forked from this process (`make lab`, the starter)
    torchrun_command(script, nproc)    the torchrun command line that all of these (and tools/) use

Why not `torch.multiprocessing.spawn` from a notebook? Spawn pickles the function by name and cannot
find one defined in a notebook. Why not fork the kernel itself? On a machine with CUDA, a process
forked after its parent ran any backward() cannot run backward() ("Unable to handle autograd's
threading in combination with fork-based multiprocessing"), nor use CUDA once the parent did. So
`run_ranks` sends the function *by value* (cloudpickle) to a rank starter: a fresh Python process that
imported torch once, never runs autograd or touches CUDA, and forks the ranks on request in
milliseconds. The ranks meet through a FileStore in a fresh temporary directory (no ports to
collide), capture their output, and send it back with their return value; the kernel prints every
rank's output in rank order, the same text on every run.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, NamedTuple

ROOT = Path(__file__).resolve().parent.parent  # the course folder: chapters/, labs/, solutions/, ...

try:  # pickles a function defined in a notebook by value; without it, ranks fork from this process
    import cloudpickle
except ImportError:  # pragma: no cover - it is in requirements.txt
    cloudpickle = None


class RankError(RuntimeError):
    """A rank raised an exception; the message holds its rank and traceback."""

    def __init__(self, rank: int, error: str, output: str = ""):
        self.rank, self.error, self.output = rank, error, output
        super().__init__(f"rank {rank} raised an exception:\n{error}")


class RanksTimeout(TimeoutError):
    """Some ranks had not finished when the time ran out (often a deadlock)."""

    def __init__(self, running: list[int], timeout: float, outputs: dict[int, str]):
        self.running, self.outputs = running, outputs
        names = ", ".join(str(r) for r in running)
        super().__init__(
            f"rank(s) {names} still running after {timeout:g} s and were killed: likely a "
            f"deadlock (a recv, wait or collective that another rank never joined)"
        )


def _reservation(host: str) -> socket.socket:
    """A socket bound to a port the kernel chose, with SO_REUSEADDR, never listening.

    While it stays open the kernel gives that port to no other bind to port 0 (another launch's
    free_port, a gloo listener), yet a server meant for it can still bind and listen there: TCPStore
    and libuv set SO_REUSEADDR too. A port merely found free and closed again can be taken by someone
    else before the server binds it; with several tests launching at once, that happened."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


_RESERVED: list[socket.socket] = []  # free_port's reservations, held for the life of this process


def free_port(host: str = "127.0.0.1") -> int:
    """A free port, reserved for this process (see _reservation) until it exits: a group's store can
    be started on it at any later time, by this process or by one it starts."""
    _RESERVED.append(_reservation(host))
    return _RESERVED[-1].getsockname()[1]


@contextmanager
def reserved_port(host: str = "127.0.0.1"):
    """A free port, reserved (see _reservation) until the with-block ends."""
    with _reservation(host) as s:
        yield s.getsockname()[1]


# --- Forking ranks and collecting what they did (the one fork skeleton) ---------------------------


def _dumps(value: Any) -> bytes:
    return (cloudpickle or pickle).dumps(value)


def _rank_body(rank, n, fn, args, kwargs, backend, store_path, collective_timeout, quiet_fds, results, release):
    """One forked process: (join the group,) run fn, send back (rank, status, value, output)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the cores; one thread each avoids oversubscription
    if quiet_fds:  # PyTorch's C++ warnings carry time stamps: keep them out of a notebook's output
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    output = io.StringIO()
    status, value = "ok", None
    try:
        with redirect_stdout(output), redirect_stderr(output):
            if backend is not None:
                store = dist.FileStore(store_path, n)
                dist.init_process_group(backend, store=store, rank=rank, world_size=n,
                                        timeout=timedelta(seconds=collective_timeout))
            value = fn(rank, n, *args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - everything a rank raises goes back to the caller
        status, value = "error", (traceback.format_exc() if backend is not None
                                  else f"{type(error).__name__}: {error}")
    try:
        payload = pickle.dumps((rank, status, _dumps(value) if status == "ok" else value, output.getvalue()))
    except Exception:  # the return value could not be pickled
        payload = pickle.dumps((rank, "error", traceback.format_exc(), output.getvalue()))
    results.put(payload)
    results.close()
    results.join_thread()  # the queue's feeder thread must write the payload before os._exit
    # Stay in the group until every rank is done: a rank that left early would make a peer still
    # waiting on it fail with "connection closed" instead of showing the real problem.
    if release is not None:
        release.wait()
    # Leave without the interpreter's shutdown (see runtime.finish); a rank whose collective failed
    # may hold a broken group, so skip destroy_process_group there.
    if status == "ok" and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    os._exit(0)


def _fork_and_collect(fn, n, args, kwargs, backend, timeout, collective_timeout, quiet_fds=False,
                      hold=True, stop_on_error=True) -> dict[int, tuple[str, Any, str]]:
    """Fork n processes running fn; return rank -> (status, value bytes or error text, output)
    for every process that reported within `timeout` seconds. The rest are killed."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    release = ctx.Event() if hold else None
    tmpdir = tempfile.mkdtemp(prefix="ringside-")
    procs = [ctx.Process(target=_rank_body, daemon=True,
                         args=(r, n, fn, args, kwargs, backend, os.path.join(tmpdir, "store"),
                               collective_timeout, quiet_fds, results, release))
             for r in range(n)]
    reports: dict[int, tuple[str, Any, str]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(reports) < n and time.monotonic() < deadline:
            try:
                rank, status, value, out = pickle.loads(results.get(timeout=0.05))
                reports[rank] = (status, value, out)
                if status == "error" and stop_on_error:
                    # One failed rank often leaves the others waiting for it: give them a moment to
                    # fail too (their own collective timeout), then stop.
                    deadline = min(deadline, time.monotonic() + 2.0)
                continue
            except queue_module.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank not in reports and not p.is_alive() and p.exitcode not in (0, None):
                    reports[rank] = ("error", f"the process died with exit code {p.exitcode}", "")
    finally:
        if release is not None:
            release.set()  # ranks that reported now exit; ranks still running are killed
        grace = time.monotonic() + 3
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return reports


def python() -> str:
    """The interpreter for torchrun's agent: PYTHON_EXEC where it is set (torchrun starts its workers
    with it too; the test suite points it at a Python with torch imported already), else ours. (Not
    the rank starter's: forked ranks of FSDP jobs lost a peer, under load, with a starter forked so.)"""
    return os.environ.get("PYTHON_EXEC") or sys.executable


# --- The rank starter: a fresh process that forks the ranks ---------------------------------------


class _Starter:
    """The kernel's handle on its rank starter process (started once, reused by every call)."""

    current: "_Starter | None" = None

    def __init__(self):
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        env = dict(os.environ, RINGSIDE_STARTER_FDS=f"{request_r},{reply_w}", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from ringside.launch import _serve; _serve()"],
            pass_fds=(request_r, reply_w), env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killing it kills its ranks too
        )
        os.close(request_r)
        os.close(reply_w)
        self.requests = Connection(request_w, readable=False)
        self.replies = Connection(reply_r, writable=False)

    @classmethod
    def get(cls) -> "_Starter":
        if cls.current is None or cls.current.proc.poll() is not None:
            cls.current = cls()
        return cls.current

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.requests.close()
        self.replies.close()
        if _Starter.current is self:
            _Starter.current = None


def start_rank_starter() -> None:
    """Start the rank starter now (it takes a few seconds to import torch), so that the first
    run_ranks call does not wait for it. `import ringside` does this inside a Jupyter kernel."""
    if cloudpickle is not None:
        _Starter.get()


# Imported once by a process that forks ranks, and inherited by every rank: `import torch` is about
# 2 s of CPU, and DDP's first use imports torch._dynamo (2 s more). Nothing here starts a thread or
# touches CUDA, so forking afterwards is safe.
PREIMPORTS = ("torch", "torch.distributed", "torch._dynamo")


def preimport(*names: str) -> None:
    import torch

    torch.set_num_threads(1)
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _serve() -> None:
    """Body of the rank starter: read jobs, fork their ranks, send back the reports."""
    request_fd, reply_fd = map(int, os.environ.pop("RINGSIDE_STARTER_FDS").split(","))
    requests, replies = Connection(request_fd, writable=False), Connection(reply_fd, readable=False)
    preimport(*PREIMPORTS, "matplotlib.figure")  # notebooks' ranks draw too
    while True:
        try:
            blob = requests.recv_bytes()
        except (EOFError, OSError):  # the kernel is gone: so are we, and our ranks
            os.killpg(0, signal.SIGKILL)
        try:
            path, job = pickle.loads(blob)
            sys.path[:] = path + [p for p in sys.path if p not in path]
            function, kwargs = pickle.loads(job)  # unpickled only once sys.path is the caller's
            reply = ("reports", function(**kwargs))
        except Exception:
            reply = ("error", traceback.format_exc())
        replies.send_bytes(pickle.dumps(reply))


def _print_outputs(outputs: dict[int, str]) -> None:
    for rank in sorted(outputs):
        for line in outputs[rank].splitlines():
            print(f"[rank {rank}] {line}")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 4,
    *args: Any,
    timeout: float = 60,
    backend: str = "gloo",
    show_output: bool = True,
    collective_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` ranks joined in one group.

    Returns the ranks' return values, in rank order. What the ranks print is shown afterwards,
    rank by rank, each line prefixed with "[rank r]" (show_output=False keeps it quiet).
    Raises RankError (with the rank and its traceback) if any rank raised, and RanksTimeout,
    after killing every rank, if some had not finished within `timeout` seconds.
    `collective_timeout` bounds each collective inside the ranks; by default it is longer than
    `timeout`, so that a deadlock is always reported as RanksTimeout, never as a race between the
    two limits. Create CUDA tensors only inside fn: the ranks are fresh, the kernel's state is not."""
    job = dict(fn=fn, n=world_size, args=args, kwargs=kwargs, backend=backend, timeout=timeout,
               collective_timeout=collective_timeout or timeout + 30)
    reports = _run_job(job, timeout)
    outputs = {rank: out for rank, (_, _, out) in reports.items()}
    if show_output:
        _print_outputs(outputs)
    failed = [rank for rank in reports if reports[rank][0] == "error"]  # in order of arrival
    if failed:  # the first failure is the cause; ranks still waiting for it are its victims
        status, error, out = reports[failed[0]]
        raise RankError(failed[0], error, out)
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        raise RanksTimeout(missing, timeout, outputs)
    return [pickle.loads(reports[r][1]) for r in range(world_size)]


def _run_job(job: dict, timeout: float) -> dict[int, tuple[str, Any, str]]:
    """Run a fork job in the rank starter (or, without cloudpickle, from this very process)."""
    if cloudpickle is None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError("CUDA is already initialized in this process, and forked ranks cannot use "
                               "it: install cloudpickle (pip install cloudpickle) or restart the kernel.")
        importlib.import_module("torch._dynamo")
        return _fork_and_collect(**job)
    return _in_starter(_fork_and_collect, job, timeout, on_timeout=RanksTimeout(list(range(job["n"])), timeout, {}))


def _in_starter(function: Callable[..., Any], kwargs: dict, timeout: float, on_timeout: BaseException) -> Any:
    """function(**kwargs), run in the rank starter; `on_timeout` is raised (and the starter stopped)
    if no answer came within `timeout` seconds plus a margin for the starter's first start."""
    with _STARTER_LOCK:  # one job at a time on its pipe, even from several threads
        return _in_starter_locked(function, kwargs, timeout, on_timeout)


_STARTER_LOCK = threading.Lock()


def _in_starter_locked(function: Callable[..., Any], kwargs: dict, timeout: float, on_timeout: BaseException) -> Any:
    starter = _Starter.get()
    try:
        starter.requests.send_bytes(pickle.dumps(([p for p in sys.path if isinstance(p, str)],
                                                  cloudpickle.dumps((function, kwargs)))))
        # `function` enforces `timeout` itself; this backstop also covers the starter's first start.
        if not starter.replies.poll(timeout + 120):
            starter.stop()
            raise on_timeout
        kind, reply = pickle.loads(starter.replies.recv_bytes())
    except BaseException as error:  # interrupted by the learner, or the starter died: start afresh next time
        if error is not on_timeout:
            starter.stop()
        raise
    if kind == "error":
        raise RuntimeError(f"the rank starter could not run this job:\n{reply}")
    return reply


# --- Processes with no group: chapter 05 ----------------------------------------------------------


class Outcome(NamedTuple):
    """What one forked process did: status is "ok", "error" or "killed"."""

    rank: int
    status: str
    detail: str  # the return value (ok), "ExceptionType: message" (error), or why it was killed

    def says(self, *phrases: str) -> str:
        """A line that does not change between runs: the status and the first phrase found."""
        if self.status == "ok":
            return f"ok: {self.detail}"
        if self.status == "killed":
            return self.detail
        kind = self.detail.split(":", 1)[0]
        found = next((p for p in phrases if p.lower() in self.detail.lower()), None)
        return f"{kind}: ...{found}..." if found else f"{kind} (unexpected message: {self.detail[:200]})"


def fork_processes(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 10) -> list[Outcome]:
    """Run fn(rank, n, *args) in n forked processes; each either returns, raises, or is killed
    after `timeout` seconds. Unlike run_ranks, no group is formed (joining one is the lesson),
    every process is independent, and their C++ warnings are silenced."""
    job = dict(fn=fn, n=n, args=args, kwargs={}, backend=None, timeout=timeout, collective_timeout=timeout,
               quiet_fds=True, hold=False, stop_on_error=False)
    reports = _run_job(job, timeout) if "ipykernel" in sys.modules else _fork_and_collect(**job)
    outcomes = []
    for rank in range(n):
        if rank not in reports:
            outcomes.append(Outcome(rank, "killed", f"still waiting after {timeout:g} s: killed"))
            continue
        status, value, _ = reports[rank]
        outcomes.append(Outcome(rank, status, str(pickle.loads(value)) if status == "ok" else value))
    return outcomes


# --- Scripts under torchrun -----------------------------------------------------------------------


def torchrun_command(script: str | Path, nproc: int = 4, *args: str, all_ranks: bool = False,
                     nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                     run_id: str = "none", master: str | None = None, max_restarts: int = 0,
                     options: tuple[str, ...] = ()) -> list[str]:
    """The torchrun command line for `script` on `nproc` ranks per node.

    One node: --standalone (torchrun picks a free port). Several nodes: a c10d rendezvous at
    `rdzv_endpoint` ("host:port"), or a static one at `master` ("host:port") with --node-rank.
    `max_restarts`: how often torchrun restarts every rank after one failed; `options`: further
    torchrun options, as they are written on its command line."""
    cmd = [python(), "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", *options]
    if nnodes == 1 and rdzv_endpoint is None and master is None:
        cmd.append("--standalone")
    elif rdzv_endpoint is not None:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}"]
    else:
        host, port = master.rsplit(":", 1)
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    if not all_ranks:  # lines of several ranks interleave differently on every run
        cmd.append("--local-ranks-filter=0")
    return cmd + [str(script), *map(str, args)]


def quiet_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launched job: one thread per rank, no torchrun warning about it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def torchrun_script(
    script: str | Path,
    nproc: int = 4,
    *args: str,
    timeout: float = 180,
    check: bool = True,
    all_ranks: bool = False,
    env: dict[str, str] | None = None,
    show: bool = True,
    max_restarts: int = 0,
    agent: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script` under torchrun and print what rank 0 printed (all_ranks=True: every rank).

    `!torchrun ...` in a notebook ignores a failing exit status, even under nbval, and has no time
    limit; this has both. check=True raises CalledProcessError when the job fails (its stderr is
    printed first); a job still running after `timeout` seconds is killed and raises TimeoutExpired.

    RINGSIDE_LAUNCH=fork (a workshop room sets it: hub/jupyterhub_config.py): the ranks are forked
    from the kernel's rank starter, as `make lab` forks them (fork_script), unless torchrun's agent
    itself is the lesson (agent=True: its store, its failure report) or must restart them
    (max_restarts). Each rank of a real torchrun is a fresh process that imports torch
    (about 300 MB of its own, plus torchrun's); forked ranks share the starter's pages, which is
    most of what lets a box hold twice the learners (docs/INSTRUCTORS.md)."""
    if os.environ.get("RINGSIDE_LAUNCH") == "fork" and not agent and max_restarts == 0:
        result = fork_script(script, nproc, *args, timeout=timeout, env={"PYTHONUNBUFFERED": "1", **(env or {})},
                             cwd=ROOT, only_rank0=not all_ranks)
    else:
        result = subprocess.run(
            torchrun_command(script, nproc, *args, all_ranks=all_ranks, max_restarts=max_restarts),
            cwd=ROOT, env=quiet_env(env), capture_output=True, text=True, timeout=timeout,
        )
    if show:
        print(result.stdout, end="")
    if check and result.returncode != 0:
        print(result.stderr[-4000:], file=sys.stderr)
        result.check_returncode()
    return result


def torchrun_nodes(commands: list[list[str]], timeout: float = 180,
                   env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Start every command at once (one torchrun per node: they wait for each other at their
    rendezvous) and return each one's result, in order. If any still runs after `timeout` seconds,
    all are killed with their ranks (each runs in a session of its own) and TimeoutExpired is raised."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=quiet_env(env), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        results = []
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


# --- The same script on forked ranks (the tests' fast path) ---------------------------------------


def _script_rank(script: Path, args: list[str], env: dict[str, str], out: str | None, err: str | None) -> None:
    """In a forked rank: stdout/stderr to fresh files (None: the parent's, line by line), torchrun's
    variables, run the script as __main__."""
    code = 1
    try:
        import faulthandler

        faulthandler.disable()  # the caller's (pytest's) handler writes to the caller's terminal
        import logging

        # A torchrun rank starts with no logging handlers; the caller's (pytest's capture) would
        # swallow the script's records, and make its logging.basicConfig do nothing.
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
        logging.root.setLevel(logging.WARNING)
        for fd, path in ((1, out), (2, err)):
            if path is not None:
                handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(handle, fd)
                os.close(handle)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        os.environ.update(env)
        if os.environ.get("RINGSIDE_GPU_BOX") == "1":  # tests: this rank as on a GPU machine (ringside.gpubox)
            from ringside.gpubox import rehearse
            rehearse()
        sys.argv = [str(script), *args]
        sys.path[0] = str(script.parent)
        runpy.run_path(str(script), run_name="__main__")
        code = 0  # a script that returns instead of calling finish()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def fork_script(script: str | Path, nproc: int, *args: str, timeout: float = 120,
                env: dict[str, str] | None = None, nnodes: int = 1, cwd: str | Path | None = None,
                only_rank0: bool = False) -> subprocess.CompletedProcess:
    """Like `torchrun --standalone --nproc-per-node nproc script args`, on ranks forked from the rank
    starter: every rank's output (rank 0 first), and status 1 if any rank failed (as torchrun does).
    nnodes > 1: `nproc` ranks on each of `nnodes` simulated nodes, numbered as torchrun numbers a
    multi-node job (RANK = node x nproc + LOCAL_RANK), so RANK and LOCAL_RANK differ from node 1 on.

    A torchrun launch costs one `import torch` per rank (about 2 s of CPU each); forked ranks start
    in milliseconds with the same variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), so the
    script cannot tell the difference. They are forked from the rank starter, not from the caller: a
    test process has threads (pytest-xdist's, a store's, a group's) and state that a fork copies
    half-made; a rank forked from one died in CI with a fatal Python error. The ranks get the caller's
    environment and working directory (`cwd`: another one). only_rank0: rank 0's output only, as
    `torchrun --local-ranks-filter=0` shows it. Raises subprocess.TimeoutExpired if ranks still run
    after `timeout`."""
    with reserved_port() as port:
        job = dict(script=str(script), per_node=nproc, args=[str(a) for a in args], timeout=timeout,
                   environ=dict(os.environ), env=env or {}, cwd=str(cwd or os.getcwd()), port=port, nnodes=nnodes,
                   only_rank0=only_rank0)
        if cloudpickle is None:
            codes, stdout, stderr = _fork_script(**job)
        else:
            late = subprocess.TimeoutExpired([str(script)], timeout, output="the rank starter did not answer")
            codes, stdout, stderr = _in_starter(_fork_script, job, timeout, on_timeout=late)
    if None in codes:
        running = [r for r, c in enumerate(codes) if c is None]
        raise subprocess.TimeoutExpired([str(script)], timeout, output=f"ranks {running} still running\n{stdout}")
    return subprocess.CompletedProcess([str(script), *args], 0 if all(c == 0 for c in codes) else 1, stdout, stderr)


def _fork_script(script, per_node, args, timeout, environ, env, cwd, port,
                 nnodes=1, only_rank0=False) -> tuple[list[int | None], str, str]:
    """In the rank starter: fork the ranks, wait for them; (exit codes, None for a rank killed at the
    deadline; every rank's stdout; every rank's stderr)."""
    workdir = tempfile.mkdtemp(prefix="ringside-fork-")
    pids = fork_script_ranks(script, per_node, args, environ, env, cwd, port, nnodes, workdir)
    codes = _wait_pids(pids, timeout)
    read = lambda path: Path(path).read_text(errors="replace") if Path(path).exists() else ""  # noqa: E731
    shown = range(1 if only_rank0 else len(pids))
    stdout = "".join(read(f"{workdir}/{r}.out") for r in shown)
    stderr = "".join(read(f"{workdir}/{r}.err") for r in shown)
    shutil.rmtree(workdir, ignore_errors=True)
    return codes, stdout, stderr


def fork_script_ranks(script, per_node: int, args, environ: dict[str, str], env: dict[str, str], cwd: str,
                      port: int, nnodes: int = 1, workdir: str | None = None) -> list[int]:
    """Fork `script`'s ranks from this process, each with the variables torchrun would give it; their
    pids in rank order. A rank's environment is `environ`, torchrun's variables, then `env`. Its output
    goes to workdir/RANK.out and .err, or (workdir None) to this process's stdout and stderr."""
    nproc = per_node * nnodes
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(per_node), "ROLE_WORLD_SIZE": str(nproc),
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": "fork", "OMP_NUM_THREADS": "1", **env}
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        node, local = divmod(rank, per_node)
        rank_env = {**environ, **shared, "RANK": str(rank), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank),
                    "GROUP_RANK": str(node)}
        pid = os.fork()
        if pid == 0:
            os.environ.clear()  # the starter's environment is the one it started with, not the caller's now
            os.chdir(cwd)
            files = (f"{workdir}/{rank}.out", f"{workdir}/{rank}.err") if workdir else (None, None)
            _script_rank(Path(script), list(args), rank_env, *files)
        pids.append(pid)
    return pids


def _wait_pids(pids: list[int], timeout: float) -> list[int | None]:
    """Exit codes in rank order; None for a rank killed at the deadline."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return [codes.get(pid) for pid in pids]
