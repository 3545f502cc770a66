"""template/train_ddp.py under a model past one rank: corrupt checkpoints, the metrics of a stop,
activation checkpointing, sharded best/final weights, the meta-device build's buffers.

Small on purpose: 2 forked processes (conftest.launch), a few steps, tiny models. The helpers come
from tests/test_template.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_template import SCRIPT, template_module, train

pytestmark = pytest.mark.slow(1)  # forked template runs of a few steps each

FSDP_SHORT = ["--epochs", "1", "--max-steps", "6", "--checkpoint-every", "2", "--keep", "3", "--log-every", "1000",
              "--batch-size", "16", "--workers", "0", "--fsdp"]


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Other bytes in place: the file keeps its length (a bad disk, not a full one)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    assert path.stat().st_size == size


def test_corrupt_shards_are_found_and_every_rank_falls_back_together(tmp_path):
    """REVIEW E, bug 1. checkpoint-0000005 (a copy of step 4's, as a checkpoint of an earlier version:
    no SHA256SUMS) has garbage at the head of a shard: dcp.load raises CheckpointException (a
    BaseException) on every rank. checkpoint-0000004 has 4 KiB of other bytes mid-shard, which DCP
    would load without a word: its SHA256SUMS finds them. Each is skipped in one line, every rank
    goes on from step 2's, and the run ends with the uninterrupted run's weights, bit for bit; the
    retention then deletes the one that did not load."""
    plain, _ = train(tmp_path / "plain", 2, common=FSDP_SHORT)
    out = tmp_path / "run"
    out.mkdir()
    for step in (2, 4):
        shutil.copytree(tmp_path / "plain" / f"checkpoint-{step:07d}", out / f"checkpoint-{step:07d}")
    shutil.copytree(out / "checkpoint-0000004", out / "checkpoint-0000005")
    (out / "checkpoint-0000005" / "SHA256SUMS").unlink()
    overwrite(out / "checkpoint-0000005" / "__1_0.distcp", 0, b"x" * 64)
    shard = out / "checkpoint-0000004" / "__1_0.distcp"
    overwrite(shard, shard.stat().st_size // 2, os.urandom(4096))

    resumed, log = train(out, 2, common=FSDP_SHORT)
    assert "Traceback" not in log and "CheckpointException" not in log, log[-3000:]
    assert log.count("checkpoint-0000005 cannot be read (rank ") == 1, log[-3000:]
    assert re.search(r"checkpoint-0000004 cannot be read \(__1_0.distcp's SHA-256 differs from the one written at "
                     r"the save \(other bytes\)\): every rank goes on from the checkpoint before it", log), log[-3000:]
    assert "resumed from" in log and "at step 2 " in log, log[-3000:]
    assert resumed["weights_sha256"] == plain["weights_sha256"], "not bit for bit after falling back"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{s:07d}" for s in (2, 4, 6)]


def test_a_ddp_checkpoint_with_other_bytes_is_skipped(tmp_path):
    """torch.load does not check a zip archive's CRCs: 4 KiB of other bytes in a tensor load
    silently. The newest checkpoint that loads is the one before."""
    t = template_module()
    for step in (10, 20):
        torch.save({"step": step, "model": {"w": torch.randn(50_000)}}, tmp_path / f"checkpoint-{step:07d}.pt")
    newest = tmp_path / "checkpoint-0000020.pt"
    overwrite(newest, newest.stat().st_size // 2, os.urandom(4096))
    path, state = t.newest_loadable_checkpoint(tmp_path, torch.device("cpu"))
    assert path.name == "checkpoint-0000010.pt" and state["step"] == 10
