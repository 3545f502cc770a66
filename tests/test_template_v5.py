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
from ringside import run_ranks
from test_template import CHAR_LM, SCRIPT, adapted_template, saved_by, sigterm_trial, template_module, train

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
    assert (out / "final" / "SHA256SUMS").exists() and (out / "best" / ".metadata").exists()  # (DCP folders)


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


COUNTED_EVALUATION = {  # the template's metric_sums, saying each time it is called (once per validation batch)
    "metric_sums": '''
def metric_sums(outputs, targets):
    print("metric_sums called", flush=True)
    return {"loss": loss_fn(outputs.float(), targets, reduction="sum"),
            "accuracy": (outputs.argmax(1) == targets).sum(), "count": torch.tensor(targets.numel())}
''',
}


def test_a_stop_keeps_its_steps_row_the_lr_is_the_steps_own_and_the_end_validates_once(tmp_path):
    """REVIEW E, bug 2 and two smaller ones. A SIGTERM's save keeps the row of the step it saved at
    (metrics.jsonl and TensorBoard: one row per step, before and after the resume); each row's lr is
    the one its step used (OneCycleLR's first is max_lr / 25); the run's end validates once (its
    last validation is the final result): 360 images in batches of 128 are 3 calls of metric_sums."""
    script = adapted_template(tmp_path, COUNTED_EVALUATION)
    args = ["--epochs", "1", "--batch-size", "128", "--workers", "0", "--log-every", "1", "--checkpoint-every", "1000"]
    out = tmp_path / "run"
    status, log, _ = sigterm_trial(out, "step 3/", 0.0, script=script, args=[*args, "--step-delay", "0.3"])
    assert status == 0 and saved_by("SIGTERM", log), log[-3000:]
    stopped_at = torch.load(next(out.glob("checkpoint-*.pt")), weights_only=True)["step"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 1)), (stopped_at, rows)

    result, log = train(out, 1, *args[2:], script=script, common=args[:2])
    assert f"at step {stopped_at} " in log and result["step"] == 11, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 12)), rows
    assert [r["step"] for r in rows if "validation" in r] == [11], rows
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=11)
    rates = []
    for _ in range(11):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [r["lr"] for r in rows if "loss" in r] == rates and rates[0] == pytest.approx(0.1 / 25), rows
    assert log.count("metric_sums called") == 3, log[-3000:]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:  # (optional for the template)
        return
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert sorted({e.step for e in events.Scalars("train/loss")}) == list(range(1, 12))


def megabytes(key: str) -> float:
    """This process's VmRSS or VmHWM (its peak since clear_refs), in MiB."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 1024


def reset_peak() -> float:
    """Start VmHWM again from now (Linux); returns VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return megabytes("VmRSS:")


def sharded_template(layers: int):
    """The template as a module, with a model of `layers` Linear(1024, 1024) (4 MiB each), each a
    block that --fsdp shards; and glibc's malloc returning every tensor of 1 MiB or more to the
    system when freed (mallopt M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_=1048576 does), so that
    VmHWM shows the tensors alive at once."""
    import ctypes
    import importlib.util

    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_model = lambda: torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    module.fsdp_blocks = lambda model: list(model)
    return module


def test_fsdp_saves_weights_sharded_and_one_process_reads_them(tmp_path):
    """Item 3: with --fsdp, final and best are DCP folders that each rank writes its shards of; rank 0
    does not grow by the model's size (gathering the whole state_dict to it, as before, does: the
    measurement sees that too); the weights' SHA-256 is the whole model's, gathered one tensor at a
    time; one process turns each folder into a file (dcp_to_torch_save) that loads into
    build_model(), and best's into --pretrained."""
    layers = 8
    model_mb = layers * (1024 * 1024 + 1024) * 4 / 2**20

    def save(rank, world_size, out):
        import torch.distributed as dist

        module = sharded_template(layers)
        torch.manual_seed(0)
        net = module.build_sharded_model(torch.device("cpu"), None, None, False, False)
        dist.barrier()
        before = reset_peak()
        weights = module.model_weights(net, True)
        digest = module.weights_sha256(weights)
        module.save_weights(weights, out / "final.pt", True, rank == 0)
        module.save_weights(weights, out / "best.pt", True, rank == 0, extra={"step": 3, "loss": 1.5})
        sharded = megabytes("VmHWM:") - before
        dist.barrier()
        before = reset_peak()
        whole = module.full_state_dict(net, True)
        gathered = megabytes("VmHWM:") - before
        return sharded, gathered, digest, module.weights_sha256(whole) if rank == 0 else None

    (sharded, gathered, digest, whole_digest), *others = run_ranks(save, 2, tmp_path, show_output=False, timeout=120)
    print(f"[rank 0 grew by {sharded:.0f} MiB saving sharded, {gathered:.0f} MiB gathering; the model is "
          f"{model_mb:.0f} MiB]")
    assert gathered > 0.9 * model_mb, (gathered, model_mb)  # (what the measurement sees of a whole model)
    assert sharded < 0.75 * model_mb, (sharded, model_mb)  # its half, and one whole tensor at a time
    assert digest == whole_digest == others[0][2]

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    t = sharded_template(layers)
    dcp_to_torch_save(tmp_path / "final", tmp_path / "final.pt")
    model = t.build_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    assert t.weights_sha256(model.state_dict()) == digest
    torch.manual_seed(0)
    assert t.weights_sha256(t.build_model().state_dict()) == digest  # (untrained: build_model()'s weights)
    dcp_to_torch_save(tmp_path / "best", tmp_path / "best.pt")
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["step"] == 3 and best["loss"] == 1.5
    t.load_pretrained(model, str(tmp_path / "best.pt"))


def test_the_meta_device_build_makes_the_buffers_build_model_makes():
    """Item 4: --fsdp builds the model on the meta device, where buffers are empty: a rotary
    embedding's table (persistent=False: not in the state_dict) and BatchNorm's running statistics
    (here not the defaults) must come out as build_model() makes them, as must every parameter,
    bit for bit, on every rank (compared on the device the ranks train on: the CPU here)."""
    def build(rank, world_size):
        import importlib.util

        from torch import nn
        spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

        class Rotary(nn.Module):
            def __init__(self, dim: int = 8, length: int = 16):
                super().__init__()
                inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
                angles = torch.outer(torch.arange(length).float(), inv_freq)
                self.register_buffer("cos", angles.cos(), persistent=False)
                self.register_buffer("sin", angles.sin(), persistent=False)
                self.proj = nn.Linear(dim, dim)

            def forward(self, x):
                return self.proj(x)

        def build_model():
            model = nn.Sequential(Rotary(), nn.BatchNorm1d(8), nn.Linear(8, 4))
            model[1].running_mean.normal_()  # (drawn from the seeded generator, as an initialisation would)
            model[1].running_var.uniform_(0.5, 2.0)
            model[1].num_batches_tracked.fill_(7)
            return model

        module.build_model = build_model
        module.fsdp_blocks = lambda model: [model[0]]
        torch.manual_seed(0)
        net = module.build_sharded_model(torch.device("cpu"), None, None, False, False)
        torch.manual_seed(0)
        reference = build_model()
        built = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in net.named_parameters()}
        built.update(net.named_buffers())
        expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
        assert sorted(built) == sorted(expected), (sorted(built), sorted(expected))
        return [n for n in expected if not torch.equal(built[n], expected[n])]

    different = run_ranks(build, 2, show_output=False, timeout=60)
    assert different == [[], []], different


def test_activation_checkpointing_changes_no_bit_and_refuses_batchnorm(tmp_path):
    """Item 2: --activation-checkpointing recomputes each block (fsdp_blocks) in the backward. A
    transformer LM with dropout at 2 processes, FSDP and DDP: every step's loss and the final weights
    are bit for bit those without it (the recomputation draws the same dropout). The example model's
    blocks have BatchNorm, which a recomputation would update twice: refused."""
    script = adapted_template(tmp_path, {**CHAR_LM, "fsdp_blocks": "def fsdp_blocks(model):\n    return [model.block]\n"})
    common = ["--epochs", "1", "--max-steps", "4", "--checkpoint-every", "1000", "--log-every", "1",
              "--batch-size", "8", "--workers", "0", "--lr", "0.05"]
    for kind in (["--fsdp"], []):
        runs = {}
        for recompute in ([], ["--activation-checkpointing"]):
            out = tmp_path / f"{kind}{recompute}"
            result, _ = train(out, 2, *kind, *recompute, script=script, common=common)
            losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                      if "loss" in json.loads(line)]
            runs[bool(recompute)] = (losses, result["weights_sha256"])
        assert len(runs[False][0]) == 4 and runs[True] == runs[False], (kind, runs)
    t = template_module()
    with pytest.raises(SystemExit, match="has BatchNorm, whose running statistics the recomputation would update twice"):
        t.checkpoint_activations(t.build_model())
