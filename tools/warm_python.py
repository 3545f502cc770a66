"""A Python that has already imported torch, for the test suite: each `python` it starts is forked.

Every process the suite starts that imports torch pays 2-4 CPU-seconds before its first line runs
(torch, torch.distributed, torch._dynamo): torchrun's agents and workers, each notebook's kernel.
On 2 cores, hundreds of them are minutes.
This server imports them once; a `python ...` started through its client is a child forked from it
that takes over the caller's arguments, environment, working directory and standard streams, and
runs as `python` would. torchrun starts its workers with `PYTHON_EXEC` (torch/distributed/run.py
reads it), the tests' torchrun agents and notebook kernels use it too, so
nothing the tests exercise changes: the same torchrun agent, the same signals, the same exit codes.

    env = start()        # {"PYTHON_EXEC": client, "RINGSIDE_WARM": socket}: put them in os.environ
    ...                  # every `$PYTHON_EXEC ...` below here starts warm
    stop()

What the client does: sends its argv, environment, cwd and file descriptors 0-2 to the server, which
forks; passes on every signal it gets (SIGTERM from torchrun, SIGINT from a terminal) to the child's
process group; and exits as the child did (the same code, or killed by the same signal). If the
client dies (SIGKILL), the server kills the child. The client runs the real interpreter instead
(`exec`) where a fork would not be the same: an option it does not know, or a variable that torch,
Python or the C libraries read at import (TORCH_CPP_LOG_LEVEL, ATEN_CPU_CAPABILITY, PYTHONPATH,
OMP_*, ...) set differently from the server's. Learners never use this: `make lab`, the notebooks and
the template run plain interpreters (and `make test-gpu` too: CUDA must not be initialized before fork).

Only the standard library at the top: the client imports this file with `python -S`.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Not matplotlib: a notebook's kernel sets MPLBACKEND before it imports matplotlib, which reads it then.
PREIMPORTS = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.run")
# What torch, Python or the C libraries read as they start: a child given another value than the
# server started with would not be what a fresh `python` is, so that one starts cold.
AT_IMPORT = re.compile(r"(TORCH(?!ELASTIC_|_ELASTIC_|_NCCL_|_FR_).*|ATEN_.*|PYTHON(?!UNBUFFERED$|_EXEC$).*|LD_.*"
                       r"|OMP_.*|MKL_.*|KMP_.*|MALLOC_.*|GLIBC_.*|CUDA_.*|NVIDIA_.*)")
STREAM_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_server: subprocess.Popen | None = None
_folder: Path | None = None
_BEFORE_IMPORTS: dict[str, str] = {}  # the server's environment as it started, and what its imports added
_SET_BY_IMPORTS: dict[str, str] = {}


# --- The caller's side ----------------------------------------------------------------------------


def start() -> dict[str, str]:
    """Start the server (once per process tree that asks) and return the variables that route
    `PYTHON_EXEC` through it. The server exits with its parent."""
    global _server, _folder
    folder = _folder = Path(tempfile.mkdtemp(prefix="ringside-warm-"))
    path, client = folder / "socket", folder / "python"
    client.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                      "from tools.warm_python import client\nclient()\n")
    client.chmod(0o755)
    _server = subprocess.Popen([sys.executable, "-c", f"from tools.warm_python import serve; serve({str(path)!r})"],
                               cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not path.exists():  # it binds the socket once torch is imported
        if _server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the warm Python server did not start (exit status {_server.poll()})")
        time.sleep(0.05)
    return {"PYTHON_EXEC": str(client), "RINGSIDE_WARM": str(path)}


def stop() -> None:
    if _server is not None and _server.poll() is None:
        _server.terminate()
        _server.wait(timeout=30)
    if _folder is not None:  # its socket and client script
        shutil.rmtree(_folder, ignore_errors=True)


def client() -> None:
    """`python ARGS` (this file's own interpreter), forked from the server when it can be."""
    argv = sys.argv[1:]
    # the signals our caller left ignored (they stay so through exec): so shall the child's be
    status = Path("/proc/self/status").read_text()
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    pending: list[int] = []
    child: list[int] = []

    def pass_on(signum, _frame):
        if child:
            try:
                os.killpg(child[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for signum in STREAM_SIGNALS:
        signal.signal(signum, pass_on)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(os.environ["RINGSIDE_WARM"])
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) != conn.fileno())
        fds = [fd for fd in fds if _is_open(fd)]  # (listdir's own descriptor is closed by now)
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds,
                              "ignored": ignored}).encode()
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], fds)
        reader = conn.makefile("r")
        answer = reader.readline().split()
    except (OSError, KeyError):
        answer = []
    if not answer or answer[0] != "pid":  # "cold", or no server: the real interpreter, as if called directly
        for signum in STREAM_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, *argv])
    child.append(int(answer[1]))
    for signum in pending:
        pass_on(signum, None)
    line = reader.readline().split()  # "status N" once the child has exited
    if not line:
        print("warm python: the server went away", file=sys.stderr)
        os._exit(1)
    status = int(line[1])
    if os.WIFSIGNALED(status):  # die of the same signal, as torchrun expects of its worker
        if os.WTERMSIG(status) != signal.SIGKILL:  # (whose action cannot be set: it is the default)
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


# --- The server -----------------------------------------------------------------------------------


def serve(path: str) -> None:
    import importlib

    global _BEFORE_IMPORTS, _SET_BY_IMPORTS
    _BEFORE_IMPORTS = dict(os.environ)
    for name in PREIMPORTS:
        importlib.import_module(name)
    # torch._dynamo sets TORCHINDUCTOR_CACHE_DIR when imported: a fresh process would have it too
    _SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if k not in _BEFORE_IMPORTS}
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the caller waits for this name: ready
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)

    def shut(*_):  # each child killed, and its client told so: it dies of SIGKILL too, as if killed itself
        for pid, conn in children.items():
            _kill(pid)
            try:
                conn.sendall(f"status {os.waitpid(pid, 0)[1]}\n".encode())
            except OSError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, shut)
    while True:
        for key, _ in selector.select(0.05):
            if key.fileobj is listener:
                _accept(listener, selector, children)
            else:  # the client hung up before its child exited: it was killed, so is the child
                conn = key.fileobj
                if not _readable_data(conn):
                    selector.unregister(conn)
                    pid = next(p for p, c in children.items() if c is conn)
                    _kill(pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"status {status}\n".encode())
                except OSError:
                    pass
                try:
                    selector.unregister(conn)
                except (KeyError, ValueError):  # already, when its client hung up first
                    pass
                conn.close()
        if os.getppid() != parent:  # whoever started us is gone
            shut()


def _readable_data(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(64))
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _accept(listener, selector, children) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(10)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 250)
        client_pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        size = int.from_bytes(data[:8], "big")
        while len(data) < 8 + size:
            more = conn.recv(1 << 16)
            if not more:
                raise EOFError
            data += more
        request = json.loads(data[8:8 + size])
        if (len(fds) != len(request["fds"]) or request["fds"][:3] != [0, 1, 2]
                or (uid, gid) != (os.getuid(), os.getgid()) or _elsewhere(client_pid) or _cold(request)):
            conn.sendall(b"cold\n")
            raise EOFError
        pid = os.fork()
        if pid == 0:
            selector.close()
            for other in (listener, conn, *children.values()):
                other.close()
            _become(request, fds, client_pid)
        children[pid] = conn
        conn.sendall(f"pid {pid}\n".encode())
        conn.settimeout(None)
        selector.register(conn, selectors.EVENT_READ)
    except (OSError, EOFError, ValueError):
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)


def _elsewhere(pid: int) -> bool:
    """True when the client runs in another namespace than ours (tools/cluster.py's hosts are network
    namespaces): a child forked here would not see its network, mounts or host name."""
    try:
        return any(os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
                   for ns in ("net", "mnt", "uts", "ipc", "pid", "user"))
    except OSError:
        return True


def _cold(request: dict) -> bool:
    """True where a forked child would not be what `python ARGV` is: run the real one."""
    env = request["env"]
    differs = {k for k in set(env) | set(_BEFORE_IMPORTS) if env.get(k) != _BEFORE_IMPORTS.get(k)
               and not (k in _SET_BY_IMPORTS and env.get(k) == _SET_BY_IMPORTS[k])}  # set by the same imports
    cold = sorted(k for k in differs if AT_IMPORT.fullmatch(k)) or ([] if _target(request["argv"]) else ["argv"])
    if os.environ.get("RINGSIDE_WARM_LOG"):  # each start, and why it was cold (maintainers: is the suite warm?)
        with open(os.environ["RINGSIDE_WARM_LOG"], "a") as log:
            print(f"{'cold ' + str(cold) if cold else 'warm'} {request['argv'][:3]}", file=log)
    return bool(cold)


def _target(argv: list[str]) -> tuple[str, str, list[str], bool] | None:
    """(kind, what, its arguments, unbuffered) for `python [-u] [-B] (-c CODE | -m MODULE | SCRIPT) ARGS`,
    None for anything else (other options, an interactive interpreter)."""
    unbuffered, i = False, 0
    while i < len(argv) and argv[i] in ("-u", "-B"):
        unbuffered |= argv[i] == "-u"
        i += 1
    if i >= len(argv):
        return None
    if argv[i] in ("-c", "-m"):
        return (argv[i], argv[i + 1], argv[i + 2:], unbuffered) if i + 1 < len(argv) else None
    if argv[i].startswith("-"):
        return None
    return "script", argv[i], argv[i + 1:], unbuffered


# --- The child: become `python ARGV` --------------------------------------------------------------


def _become(request: dict, fds: list[int], client_pid: int) -> None:
    import io
    import runpy
    import types

    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, which the client signals (torchrun signals the client's)
        _take_descriptors(fds, request["fds"])
        _join_cgroups(client_pid)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in _SET_BY_IMPORTS.items():
            os.environ.setdefault(key, value)
        for signum in STREAM_SIGNALS:  # as `python` sets them up when its caller ignored them or not
            if request["ignored"] >> (signum - 1) & 1:
                signal.signal(signum, signal.SIG_IGN)
            else:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        kind, what, args, unbuffered = _target(request["argv"])
        unbuffered |= bool(os.environ.get("PYTHONUNBUFFERED"))
        for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
            raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
            binary = raw if (unbuffered and fd) else (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw))
            stream = io.TextIOWrapper(binary, encoding=sys.stdout.encoding, errors="backslashreplace" if fd == 2
                                      else sys.stdout.errors, line_buffering=fd == 2 or raw.isatty(),
                                      write_through=unbuffered and fd > 0)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()
        if kind == "script":
            sys.argv = [what, *args]
            sys.path[0] = str(Path(what).resolve().parent)
            runpy.run_path(what, run_name="__main__")
        elif kind == "-m":
            sys.argv = [what, *args]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(what, alter_argv=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(what, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:  # what the interpreter does: the traceback, then die of SIGINT
        _print_exception()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        _print_exception()
    _finish()
    os._exit(code)


def _print_exception() -> None:
    """The traceback `python` prints: from the script's frame on, without this file's and runpy's."""
    import runpy

    kind, error, trace = sys.exc_info()
    while trace is not None and (trace.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                                 or trace.tb_frame.f_code.co_filename.startswith("<frozen")):
        trace = trace.tb_next
    if trace is not None:
        error.__traceback__ = trace  # the interpreter's hook prints the exception's own traceback
    sys.excepthook(kind, error, error.__traceback__)


def _take_descriptors(received: list[int], numbers: list[int]) -> None:
    """The client's open files at the numbers they had there (a rank starter's pipes are named by
    number in its environment). The server has no files of its own past 2 that a child keeps."""
    import fcntl

    above = max(numbers + received) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(moved, numbers):
        os.dup2(fd, number)  # inheritable, as it was in the client (it survived the client's exec)
        os.close(fd)


def _join_cgroups(pid: int) -> None:
    """Into the client's cgroups, where it is not in ours: its CPU is then counted where the client's
    would be (make test-cost, a Slurm job), and limits bound it. Only root may; others stay."""
    theirs, ours = (Path(f"/proc/{p}/cgroup").read_text().splitlines() for p in (pid, "self"))
    if theirs == ours:
        return
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    for line in set(theirs) - set(ours):
        _, controllers, path = line.split(":", 2)
        for _, where, kind, options, *_ in mounts:
            v1 = kind == "cgroup" and set(controllers.split(",")) <= set(options.split(",")) and controllers
            if v1 or (kind == "cgroup2" and not controllers):
                try:
                    Path(where, path.lstrip("/"), "cgroup.procs").write_text(f"{os.getpid()}\n")
                except OSError:
                    pass


def _finish() -> None:
    """What the interpreter does on its way out: wait for threads, run atexit, flush the streams."""
    import atexit
    import threading

    try:
        threading._shutdown()
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
