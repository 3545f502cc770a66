"""tools/warm_python.py: a `python` forked from a server that imported torch behaves as `python` does.

The suite starts it (conftest.start_warm_python), and torchrun's workers, the notebooks' kernels and
the rank starters run through it, so each difference from a fresh interpreter would be a difference
between what the tests see and what a learner runs. Each case runs the same small script both ways
and compares what can be seen from outside: output, exit status, traceback, signals, open files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WARM = os.environ.get("PYTHON_EXEC")
pytestmark = pytest.mark.skipif(not os.environ.get("RINGSIDE_WARM") or not WARM,
                                reason="the warm Python is off (RINGSIDE_WARM=0)")

SCRIPT = '''
import os, sys
print("argv", sys.argv, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("env", os.environ.get("MARK"), "cwd", os.getcwd())
print("to stderr", file=sys.stderr)
if os.environ.get("FD"):
    os.write(int(os.environ["FD"]), b"through an inherited file\\n")
if os.environ.get("PIDFILE"):
    open(os.environ["PIDFILE"], "w").write(str(os.getpid()))
    import time; time.sleep(60)
if sys.argv[1:] == ["fail"]:
    raise ValueError("boom")
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
'''


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def both(*args, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The same command under the warm Python and under this interpreter."""
    env = dict(os.environ, MARK="m", **kwargs.pop("env", {}))
    return tuple(subprocess.run([python, *map(str, args)], capture_output=True, text=True, env=env, timeout=60,
                                **kwargs) for python in (WARM, sys.executable))


def test_output_status_and_traceback_are_pythons(script, tmp_path):
    for args in ([script, "3"], ["-u", script, "0"], [script, "fail"]):
        warm, cold = both(*args, cwd=tmp_path)
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    warm, cold = both("-c", "import sys; print(sys.argv, sys.path[0])", "x")
    assert warm.stdout == cold.stdout == "['-c', 'x'] \n"


def test_starts_with_torch_imported_unless_a_variable_read_at_import_differs():
    code = "import sys; print('torch' in sys.modules)"
    assert both("-c", code)[0].stdout == "True\n"
    assert both("-c", code, env={"TORCH_CPP_LOG_LEVEL": "INFO"})[0].stdout == "False\n"  # ran cold


def test_inherited_files_keep_their_numbers(script):
    read, write = os.pipe()
    try:
        warm, _ = both(script, env={"FD": str(write)}, pass_fds=(write,))
        assert warm.returncode == 0
        os.close(write)
        assert os.read(read, 100).count(b"through an inherited file") == 2  # warm, then cold
    finally:
        os.close(read)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_client_reaches_the_child(script, tmp_path, signum):
    """torchrun stops its workers with SIGTERM (SIGKILL after its grace); a terminal sends SIGINT.
    The caller sees the status a killed `python` has, and no child outlives its client."""
    pidfile = tmp_path / "pid"
    # (started as from a terminal: a shell's background job, pytest's own perhaps, ignores SIGINT, and
    # a `python` it starts then does too - as the warm one does: the client says which it ignores)
    proc = subprocess.Popen([WARM, script], env=dict(os.environ, PIDFILE=str(pidfile)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == -signum
    child = int(pidfile.read_text())
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"the child {child} outlived its client"
        time.sleep(0.05)
