"""Chapter 11: synchronized BatchNorm on the CPU, and a job that survives a killed rank.

The kill-and-resume test runs the capstone at 2 ranks: once uninterrupted, once with rank 1
killing itself (SIGKILL) mid-epoch and no restart, then that job launched again by hand. The script
resumes because the checkpoint exists, not because of a restart counter (torchrun's is counted per
node and can differ between nodes), and the final weights must equal the uninterrupted run's bit for
bit. (Chapter 11's notebook runs the other way back, a restart by `torchrun --max-restarts=1`, and
nbval holds it to "bit for bit: True".)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import LAUNCH_TIMEOUT, ROOT, launch
from torch import nn

from ringside import run_ranks
from ringside.launch import torchrun_script
from ringside.syncbn import convert_sync_batchnorm

pytestmark = pytest.mark.slow(3)  # real torchrun jobs, killed and resumed

SCRIPT = ROOT / "solutions" / "11_capstone.py"
QUICK = ["--epochs", "2", "--no-resume-check"]  # 44 steps at 2 ranks: enough to kill one mid-way


def syncbn_against_gathered_batch(rank, world_size):
    """This rank's part of a global batch through SyncBatchNorm vs BatchNorm on the whole batch."""
    torch.manual_seed(0)
    sizes = [3 + r for r in range(world_size)]  # unequal batches: the count is all-reduced too
    full = torch.randn(sum(sizes), 4, 5, 5) * 2 + 1
    upstream = torch.randn_like(full)
    part = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    ref = nn.BatchNorm2d(4)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2)
        ref.bias.uniform_(-1, 1)
    mine = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), backend="gloo")
    mine[0].load_state_dict(ref.state_dict())
    x_ref = full.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * upstream).sum().backward()
    x = full[part].clone().requires_grad_()
    y = mine(x)
    (y * upstream[part]).sum().backward()
    grad_w, grad_b = mine[0].weight.grad.clone(), mine[0].bias.grad.clone()
    dist.all_reduce(grad_w)  # local weight gradients add up to the global one (DDP averages them)
    dist.all_reduce(grad_b)
    return type(mine[0]).__name__, max(
        (y - y_ref[part]).abs().max().item(),
        (x.grad - x_ref.grad[part]).abs().max().item(),
        (grad_w - ref.weight.grad).abs().max().item(),
        (grad_b - ref.bias.grad).abs().max().item(),
        (mine[0].running_mean - ref.running_mean).abs().max().item(),
        (mine[0].running_var - ref.running_var).abs().max().item(),
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_syncbn_equals_batchnorm_on_the_gathered_batch(world_size):
    results = run_ranks(syncbn_against_gathered_batch, world_size, show_output=False, timeout=60)
    for name, worst in results:
        assert name == "SyncBatchNorm"
        assert worst < 1e-5, worst  # float32 values of order 1-10: a few ulps, not a mistake


def test_converter_picks_native_syncbn_for_nccl():
    converted = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), backend="nccl")
    assert type(converted[0]) is nn.SyncBatchNorm


def capstone(out: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    try:
        return torchrun_script(SCRIPT, 2, "--out", str(out), *QUICK, *args, all_ranks=True, max_restarts=restarts,
                               check=False, show=False, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the capstone still ran after {LAUNCH_TIMEOUT} s (a hang?): {expired.stdout!r}")


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def test_relaunched_job_resumes_from_the_checkpoint(tmp_path):
    """No restart counter decides: a job launched again by hand (restart count 0 on every node)
    resumes because the checkpoint exists, and ends where an uninterrupted run ends. The dying run
    needs the real torchrun (it ends the surviving rank); the other two are forked, which the script
    cannot tell from torchrun (the same variables) and costs no `import torch` per rank."""
    plain = launch(SCRIPT, 2, "--out", str(tmp_path / "plain"), *QUICK)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]

    died = capstone(tmp_path / "relaunched", "--kill-rank", "1", "--kill-at-step", "35", restarts=0)
    assert died.returncode != 0, died.stdout[-3000:]
    assert "killing myself (SIGKILL) before step 35" in died.stdout, died.stdout[-3000:]
    assert (tmp_path / "relaunched" / "checkpoint.pt").exists()

    again = launch(SCRIPT, 2, "--out", str(tmp_path / "relaunched"), *QUICK, "--kill-rank", "1", "--kill-at-step", "35")
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-4000:]
    assert "at epoch 1, step 30" in again.stdout and "killing myself" not in again.stdout, log[-3000:]
    a, b = final_weights(tmp_path / "plain"), final_weights(tmp_path / "relaunched")
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"not bit-for-bit equal after the relaunch: {different}"
    assert not list((tmp_path / "relaunched").glob(".*.tmp")), "a temporary checkpoint file was left behind"
    assert not (tmp_path / "relaunched" / "checkpoint.pt").exists(), "a finished run must leave no checkpoint"
