"""`make test-gpu`: the course on a machine with CUDA GPUs, with the torch that machine already has.

- every solution under torchrun on nccl (RINGSIDE_BACKEND=nccl): at 1 rank, and at as many ranks as
  the GPUs allow (nccl refuses two ranks on one GPU); a lab that needs more ranks than GPUs is skipped
  with its reason;
- the capstone killed mid-run and restarted by torchrun on the GPU: bit-identical final weights;
- the template (template/train_ddp.py) on 1 GPU (tests/test_template.py, selected by `-k gpu`);
- every notebook top to bottom: with nbval where it is installed, else with tests/gpu/nbrun.py
  (the same comparison of text outputs, without Jupyter), four notebooks at a time.
On a machine without CUDA every test here is skipped (`make test-gpu` says so in one line first).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ROOT, solutions
from mutation import nprocs

from ringside.lab import pass_line
from ringside.launch import quiet_env, torchrun_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL = {"RINGSIDE_BACKEND": "nccl", "PYTHONPATH": str(ROOT)}
TIMEOUT = 300


def torchrun(script: Path, nproc: int, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    return torchrun_script(script, nproc, *args, all_ranks=True, max_restarts=restarts, env=NCCL, check=False,
                           show=False, timeout=TIMEOUT)


def rank_counts(stem: str) -> list[int]:
    """1, and the most ranks this machine's GPUs allow (at most the largest count the suite uses)."""
    most = min(GPUS, max(nprocs(stem)))
    return sorted({1, most}) if most >= 2 else [1]


def cases():
    for path in solutions():
        for nproc in rank_counts(path.stem):
            yield pytest.param(path, nproc, id=f"{path.stem}-{nproc}gpus")


@pytest.mark.parametrize("solution, nproc", list(cases()) if GPUS else [])
def test_solution_on_nccl(solution, nproc):
    result = torchrun(solution, nproc)
    out = result.stdout + result.stderr
    # A lab that cannot check this world size says so in one line (its ranks exit 2, but torchrun
    # reports any failed rank as 1, so the line is what tells a refusal from a failure).
    refusal = next((line for line in result.stderr.splitlines() if " cannot check " in line), None)
    if result.returncode != 0 and refusal:
        pytest.skip(f"{refusal} (nccl: one GPU per rank)")
    assert result.returncode == 0, f"{solution.name} on {nproc} GPU(s), nccl:\n{out[-4000:]}"
    assert pass_line(nproc) in result.stdout


def run_notebook(path: Path) -> tuple[str, int, str]:
    if importlib.util.find_spec("nbval") and importlib.util.find_spec("ipykernel"):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "--nbval",
               str(path), "--nbval-sanitize-with", str(ROOT / "tests" / "sanitize.cfg"),
               "--nbval-cell-timeout", "300"]
    else:
        cmd = [sys.executable, str(ROOT / "tests" / "gpu" / "nbrun.py"), str(path)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=quiet_env({"PYTHONPATH": str(ROOT)}), capture_output=True,
                              text=True, timeout=540)
    except subprocess.TimeoutExpired:
        return path.name, 1, "still running after 540 s"
    return path.name, done.returncode, (done.stdout + done.stderr)[-3000:]


@pytest.mark.skipif(not GPUS, reason="no CUDA GPU")
@pytest.mark.timeout(900)
def test_every_notebook_top_to_bottom():
    notebooks = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run_notebook, notebooks))
    failed = [f"{name}:\n{log}" for name, code, log in results if code != 0]
    assert not failed, "\n\n".join(failed)


CAPSTONE = ROOT / "solutions" / "11_capstone.py"
QUICK = ["--epochs", "2", "--no-resume-check"]


@pytest.mark.skipif(not GPUS, reason="no CUDA GPU")
def test_capstone_killed_on_the_gpu_resumes_bit_for_bit(tmp_path):
    """One rank on nccl and autocast: killed at step 35 (after the step-30 checkpoint), restarted by
    torchrun, it must end with the uninterrupted run's weights, bit for bit (deterministic cuDNN)."""
    plain = torchrun(CAPSTONE, 1, "--out", str(tmp_path / "plain"), *QUICK)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-4000:]
    killed = torchrun(CAPSTONE, 1, "--out", str(tmp_path / "killed"), *QUICK, "--kill-rank", "0",
                      "--kill-at-step", "35", restarts=1)
    log = killed.stdout + killed.stderr
    assert killed.returncode == 0, log[-4000:]
    assert "killing myself (SIGKILL) before step 35" in killed.stdout, log[-3000:]
    assert "resumed from" in killed.stdout, log[-3000:]
    a = torch.load(tmp_path / "plain" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"not bit-for-bit equal after the restart on the GPU: {different}"
