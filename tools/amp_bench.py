"""Measure mixed precision on this machine's GPU: step time and peak memory of one training step.

    python tools/amp_bench.py                       # print the table
    python tools/amp_bench.py --json assets/amp/amp_gpu_mine.json

The same measurement as chapter 09's table (assets/amp/amp_gpu_h100.json): one training step (forward,
loss, backward, SGD step) of a ResNet-50, a transformer encoder and a wide MLP, in four modes:

- fp32: TF32 off for matmul and cuDNN (strict float32);
- tf32: TF32 on for both (float32 storage, TF32 tensor-core matmuls; Ampere and later);
- fp16+GradScaler: torch.autocast(float16) and torch.amp.GradScaler, TF32 off;
- bf16: torch.autocast(bfloat16), no scaler, TF32 off (skipped where the GPU has no bf16).

Each time is the median (and minimum) of 20 steps after 5 warm-up steps, measured with CUDA events;
peak memory is torch.cuda.max_memory_allocated over those steps. On a machine without a CUDA GPU it
says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch
from torch import nn
from torch.nn import functional as F

MODES = ("fp32", "tf32", "fp16+GradScaler", "bf16")


def resnet50(device):
    from torchvision.models import resnet50 as build
    model = build(num_classes=1000).to(device)
    x = torch.randn(128, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (128,), device=device)
    return "resnet50, batch 128, 224x224", model, x, y


def transformer(device):
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, 8, enable_nested_tensor=False), nn.Linear(1024, 1000)).to(device)
    x = torch.randn(16, 512, 1024, device=device)
    y = torch.randint(0, 1000, (16, 512), device=device)
    return "transformer encoder, 8 layers d=1024, batch 16 x 512 tokens", model, x, y


def mlp(device):
    model = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(),
                          nn.Linear(8192, 8192)).to(device)
    x = torch.randn(1024, 8192, device=device)
    y = torch.randint(0, 8192, (1024,), device=device)
    return "MLP 3 x 8192, batch 1024", model, x, y


def loss_of(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def measure(build, mode: str, device, warmup: int = 5, steps: int = 20) -> dict:
    tf32 = mode == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dtype = {"fp16+GradScaler": torch.float16, "bf16": torch.bfloat16}.get(mode)
    torch.manual_seed(0)
    name, model, x, y = build(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = loss_of(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        end.record()
        if step >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in times]
    row = {"model": name, "mode": mode, "ms_per_step_median": round(statistics.median(ms), 2),
           "ms_per_step_min": round(min(ms), 2),
           "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    del model, optimizer, x, y
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here, in the format of assets/amp/amp_gpu_h100.json")
    parser.add_argument("--models", default="resnet50,transformer,mlp", help="comma-separated subset")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("amp_bench: no CUDA GPU on this machine, nothing measured (chapter 09 shows the stored H100 table)")
        return 0
    device = torch.device("cuda", 0)
    builders = {"resnet50": resnet50, "transformer": transformer, "mlp": mlp}
    modes = [m for m in MODES if m != "bf16" or torch.cuda.is_bf16_supported(including_emulation=False)]
    rows = []
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"{'model':62} {'mode':16} {'ms/step':>8} {'peak GiB':>9}")
    for key in args.models.split(","):
        for mode in modes:
            row = measure(builders[key], mode, device)
            rows.append(row)
            print(f"{row['model']:62} {mode:16} {row['ms_per_step_median']:>8.2f} {row['peak_memory_GiB']:>9.2f}", flush=True)
    if args.json:
        result = {
            "what": "one training step (forward, loss, backward, SGD step), median of 20 after 5 warm-up steps, CUDA events",
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "note": "fp32 = TF32 off for matmul and cuDNN; tf32 = both on; autocast modes leave TF32 off",
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
