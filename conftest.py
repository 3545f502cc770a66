"""pytest, for `make test`: each notebook's cells stay together on one pytest-xdist worker, the
long tests start first, so that none of them is left running alone at the end, and every `python`
the tests start forks from one that imported torch once (tools/warm_python.py)."""

import json
import os
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config):
    start_warm_python(config)


def start_warm_python(config) -> None:
    """Every process this run starts with `import torch` forks from one Python that imported it once
    (tools/warm_python.py): torchrun's agents and workers (PYTHON_EXEC, which torchrun itself reads),
    and each notebook's kernel (a python3 kernel spec first on JUPYTER_PATH). Not the rank starters:
    the ranks they fork are forked once already. Measured: see docs/AUTHORING.md, "What each part may cost". Started once, by
    pytest-xdist's controller before its workers (they inherit the variables). RINGSIDE_WARM=0:
    every process starts cold, as a learner's do; make test-gpu does not use it (CUDA and fork)."""
    if os.environ.get("RINGSIDE_WARM") or hasattr(config, "workerinput"):
        return
    from tools import warm_python

    os.environ.update(warm_python.start())
    config.add_cleanup(warm_python.stop)
    spec = Path(tempfile.mkdtemp(prefix="ringside-kernels-")) / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [os.environ["PYTHON_EXEC"], "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python", "metadata": {"debugger": True}}))
    kernels = str(spec.parent.parent)
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [kernels, os.environ.get("JUPYTER_PATH")]))
    _WARM.update((k, os.environ[k]) for k in ("PYTHON_EXEC", "RINGSIDE_WARM"))


# Chapter 14 reads its ranks' Python stacks (faulthandler, py-spy), and a forked Python's stack goes on
# below the script's own frames: that notebook's kernel, and everything it starts, start cold.
COLD_NOTEBOOKS = ("14_debugging.ipynb",)
_WARM: dict[str, str] = {}  # the variables that route `python` through the warm one, in this process


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel as its first cell is set up, with this process's environment."""
    if not _WARM and os.environ.get("PYTHON_EXEC"):  # an xdist worker: inherited from the controller
        _WARM.update((k, os.environ[k]) for k in ("PYTHON_EXEC", "RINGSIDE_WARM") if k in os.environ)
    if Path(str(item.fspath)).name in COLD_NOTEBOOKS:
        for key in _WARM:
            os.environ.pop(key, None)
    else:
        os.environ.update(_WARM)


def pytest_collection_modifyitems(items):
    """Tests marked `slow` first, the heaviest (`slow(3)`) before the others (`slow` is `slow(1)`);
    a stable sort, so otherwise in collection order."""
    def weight(item) -> int:
        mark = item.get_closest_marker("slow")
        return 0 if mark is None else (mark.args[0] if mark.args else 1)

    items.sort(key=lambda item: -weight(item))


def pytest_xdist_make_scheduler(config, log):
    """A notebook's cells run in order in one kernel, so a notebook is one unit of work; so is
    tests/test_slurm.py, whose tests share one Slurm cluster and one time-limited job (split over two
    workers, each started a cluster and that 4-minute job of its own); every other test is a unit of
    its own and goes to whichever worker is free. Units with the most tests go first, so the
    notebooks (the longest units) start at once. (xdist's own --dist loadgroup would do this with
    marks, but under pytest 9 it no longer regroups tests.)"""
    from xdist.scheduler import LoadScopeScheduling

    together = (".ipynb", "test_slurm.py")

    class NotebooksTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(together) else nodeid

    return NotebooksTogether(config, log)
