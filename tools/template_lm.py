"""template/README.md's "adapt it to your model", measured: a small GPT-style language model.

The template adapted to a byte-level LM (causal self-attention blocks with dropout, AdamW) by
replacing only what the README's table names; then trained at 4 processes with torchrun (fresh
processes, so that glibc reads MALLOC_MMAP_THRESHOLD_=1048576 and returns freed tensors: the resident
set then shows what is alive), as DDP, FSDP, and FSDP with --activation-checkpointing. Prints how
many lines the adaptation changes, the full training state (parameters, gradients and AdamW's two
moments: 16 bytes a parameter) and each rank's peak memory above its start-up (the template's
result.json), per variant; writes them to --json.

    python -m tools.template_lm [--json assets/template_lm.json]
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # (tests/conftest.py, not the root one)

from test_template import SCRIPT, adapted_template  # noqa: E402

from ringside.launch import torchrun_script  # noqa: E402

WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 256, 4, 4, 128, 8

LM = {  # what a practitioner writes: byte tokens of a generated text, a GPT-style model, AdamW
    "build_datasets": '''
def build_datasets(seed: int) -> tuple[Dataset, Dataset]:
    """Next-byte prediction on a generated text (no download): windows of CONTEXT + 1 bytes."""
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(1234)
    words = "data parallel ring bucket rank shard gradient step optimizer checkpoint".split()
    text = " ".join(words[i] for i in torch.randint(0, len(words), (60_000,), generator=g).tolist())
    ids = torch.tensor(list(text.encode()))
    windows = ids[: len(ids) // (CONTEXT + 1) * (CONTEXT + 1)].view(-1, CONTEXT + 1)
    x, y = windows[:, :-1], windows[:, 1:]
    return TensorDataset(x[64:], y[64:]), TensorDataset(x[:64], y[:64])
''',
    "build_model": '''
CONTEXT, WIDTH, LAYERS, HEADS = {CONTEXT}, {WIDTH}, {LAYERS}, {HEADS}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, HEADS, C // HEADS).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        x = x + self.out(attended.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.position = nn.Embedding(256, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return GPT()
''',
    "fsdp_blocks": '''
def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers)
''',
    "loss_fn": '''
def loss_fn(outputs, targets, reduction="mean"):
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction=reduction)
''',
    "metric_sums": '''
def metric_sums(outputs, targets):
    return {"loss": loss_fn(outputs.float(), targets, reduction="sum"), "count": torch.tensor(targets.numel())}
''',
    "BEST_METRIC": '''
BEST_METRIC, HIGHER_IS_BETTER = "loss", False
''',
    "build_optimizer": '''
def build_optimizer(model, args, total_steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(1, total_steps))
    return optimizer, scheduler
''',
}
LM["build_model"] = LM["build_model"].replace("{CONTEXT}", str(CONTEXT)).replace("{WIDTH}", str(WIDTH)) \
    .replace("{LAYERS}", str(LAYERS)).replace("{HEADS}", str(HEADS))

VARIANTS = {"DDP": [], "FSDP": ["--fsdp"], "FSDP + activation checkpointing": ["--fsdp", "--activation-checkpointing"]}


def lines_changed(script: Path) -> tuple[int, int]:
    """(lines removed, lines added) from the template to its adaptation."""
    diff = list(difflib.unified_diff(SCRIPT.read_text().splitlines(), script.read_text().splitlines(), lineterm="", n=0))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    return removed, added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the numbers here too")
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="template-lm-"))
    script = adapted_template(folder, LM)
    removed, added = lines_changed(script)
    spec = importlib.util.spec_from_file_location("adapted", script)
    adapted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapted)
    params = sum(p.numel() for p in adapted.build_model().parameters())
    state_mib = 16 * params / 2**20
    report = {"lines_removed": removed, "lines_added": added, "parameters": params,
              "full_state_mib": round(state_mib, 1), "nproc": args.nproc,
              "settings": f"width {WIDTH}, {LAYERS} layers, context {CONTEXT}, batch {BATCH} per process, "
                          f"float32, AdamW, gloo on the CPU, MALLOC_MMAP_THRESHOLD_=1048576", "variants": {}}
    print(f"adaptation: {removed} lines removed, {added} added; {params:,} parameters, full training state "
          f"{state_mib:.0f} MiB (a {args.nproc}th: {state_mib / args.nproc:.0f} MiB)")
    for name, extra in VARIANTS.items():
        out = folder / name.replace(" ", "_")
        torchrun_script(script, args.nproc, "--out", str(out), "--epochs", "1", "--max-steps", "3", "--batch-size",
                        str(BATCH), "--workers", "0", "--log-every", "1", "--checkpoint-every", "1000",
                        "--lr", "0.001", *extra, timeout=900, show=False,
                        env={"MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1"})
        memory = json.loads((out / "result.json").read_text())["memory_mib"]
        grown = [round(p - s) for p, s in zip(memory["peak"], memory["startup"])]
        report["variants"][name] = {"peak_above_startup_mib": grown, "startup_mib": [round(s) for s in memory["startup"]]}
        print(f"{name}: peak above start-up per rank {grown} MiB ({max(grown) / state_mib:.2f} x the full state)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
