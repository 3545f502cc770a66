"""Lab 10 - exact distributed evaluation: the accuracy and mean loss of the whole data set, computed
from every rank's shard.

Each rank evaluates the shard that DistributedSampler gives it. When the world size does not divide
the data set, the sampler pads the shards with copies of the first samples, so that every rank
gets as many: those copies must not be counted. Write `local_sums` (this rank's correct count,
sample count and loss sum, padding left out) and `exact_metrics` (the totals over all ranks, then
one division). The check evaluates the same model in one process on data sets of 1,001, 13 and
7 samples (none divisible by 2, 3 or 4) and compares.

Run it with 4 processes:
    make lab CH=10 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/10_dist_eval.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/10_dist_eval.py; edit that one.)

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.data import digits

SIZES = (1001, 13, 7)  # none is divisible by 2, 3 or 4: some shards are padded
BATCH = 32


def eval_loader(dataset: TensorDataset) -> DataLoader:
    """This rank's shard, in a fixed order. DistributedSampler pads the index list 0..N-1 with
    0, 1, 2, ... up to a multiple of world_size; rank r gets the positions r, r + W, r + 2W, ..."""
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))


# --- Your part -------------------------------------------------------------------------------


def local_sums(model: nn.Module, loader: DataLoader, n_samples: int, device: torch.device) -> torch.Tensor:
    """A float64 tensor [correct, count, loss_sum] over this rank's *real* samples.

    The k-th sample this rank sees sits at position rank + k * world_size of the sampler's padded
    list; a position >= n_samples is a padding copy: leave it out of all three sums.
    loss_sum is the sum of the per-sample cross-entropy losses (F.cross_entropy(..., reduction="none"))."""
    # TODO: for each batch, find the positions rank + k * world_size of its samples, keep those < n_samples, and add up correct predictions, the count and the per-sample losses
    raise NotImplementedError("the TODO above")


def exact_metrics(sums: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean loss) over all ranks' samples, the same on every rank, from each rank's
    [correct, count, loss_sum]."""
    # TODO: add up the three sums over all ranks with dist.all_reduce (on a copy), then divide correct and loss_sum by the total count
    raise NotImplementedError("the TODO above")


# --- The check: the same evaluation in one process -------------------------------------------


def trained_model() -> nn.Module:
    """A linear classifier trained for a few full-batch steps: about 80% right, so the ranks'
    shards differ in accuracy (the same model on every rank: seeded, same data)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    x, y = digits().tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(15):
        optimizer.zero_grad()
        F.cross_entropy(model(x[1001:]), y[1001:]).backward()  # trained on the other samples
        optimizer.step()
    return model


def per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct (0/1) and loss of every sample, in one process, one batch (float64)."""
    with torch.no_grad():
        logits = model(x)
        return (logits.argmax(dim=1) == y).double(), F.cross_entropy(logits, y, reduction="none").double()


def mistakes(correct: torch.Tensor, losses: torch.Tensor, world_size: int, rank: int) -> dict[str, tuple[float, float]]:
    """What the classic mistakes would report: (accuracy, mean loss) of each."""
    n = len(correct)
    padded = torch.arange(-(-n // world_size) * world_size) % n  # the sampler's list, padding included
    shards = [torch.arange(r, n, world_size) for r in range(world_size)]  # real samples only
    per_rank = [(correct[s].mean().item(), losses[s].mean().item()) for s in shards]
    mine = padded[rank::world_size]
    return {
        "padded": (correct[padded].mean().item(), losses[padded].mean().item()),
        "averaged": (sum(a for a, _ in per_rank) / world_size, sum(b for _, b in per_rank) / world_size),
        "local": (correct[mine].mean().item(), losses[mine].mean().item()),
        "local real": per_rank[rank],
    }


def check_metrics(checks: Checks, model: nn.Module, dataset: TensorDataset, accuracy: float, loss: float) -> None:
    rank, world_size, n = dist.get_rank(), dist.get_world_size(), len(dataset)
    correct, losses = per_sample(model.cpu(), *dataset.tensors)
    ref_accuracy, ref_loss = correct.mean().item(), losses.mean().item()
    # Tolerances: the accuracy is a ratio of whole numbers, computed exactly in float64 both ways
    # (1e-12); per-sample float32 losses may differ in their last bit between batchings, and the
    # float64 sums in their order: 1e-6 on a mean loss of about 1 (the mistakes move it > 1e-5).
    acc_ok, loss_ok = abs(accuracy - ref_accuracy) <= 1e-12, abs(loss - ref_loss) <= 1e-6
    if acc_ok and loss_ok:
        checks.expect(True, "")
        return
    wrong = mistakes(correct, losses, world_size, rank)
    hints = {
        "padded": f"you counted the padded duplicates: DistributedSampler repeats "
                  f"{-(-n // world_size) * world_size - n} sample(s) so every rank gets as many - leave out "
                  f"positions >= {n}",
        "averaged": "you averaged the per-rank accuracies, but the shards have unequal sizes - add up "
                    "correct, count and loss_sum over ranks first, then divide once",
        "local": "that is this rank's own shard only - all_reduce the sums over all ranks",
        "local real": "that is this rank's own shard only - all_reduce the sums over all ranks",
    }
    index = 0 if not acc_ok else 1
    for name, values in wrong.items():
        if abs(values[index] - (accuracy, loss)[index]) <= (1e-12 if index == 0 else 1e-6):
            hint = hints[name]
            break
    else:
        hint = ("add up [correct, count, loss_sum] of the real samples (per-sample losses, "
                "reduction='none'), all_reduce them, divide once")
    what = "accuracy" if not acc_ok else "mean loss"
    got, expected = (accuracy, ref_accuracy) if not acc_ok else (loss, ref_loss)
    checks.fail(f"rank {rank}, {n} samples on {world_size} ranks: {what} {got:.6f}, a single process says "
                f"{expected:.6f}: {hint}")


def main(me: Rank, checks: Checks) -> None:
    model = trained_model()
    x, y = digits().tensors
    for n in SIZES:
        dataset = TensorDataset(x[:n], y[:n])
        sums = local_sums(model.to(me.device), eval_loader(dataset), n, me.device)
        accuracy, loss = exact_metrics(sums)
        print0(f"{n} samples on {me.world_size} ranks: accuracy {accuracy:.4f}, mean loss {loss:.4f}")
        check_metrics(checks, model, dataset, accuracy, loss)


if __name__ == "__main__":
    run_lab(main, title="Lab 10 (dist_eval)")
