"""Lab 10 - exact distributed evaluation: the accuracy and mean loss of the whole data set, computed
from every rank's shard.

Each rank evaluates the shard that DistributedSampler gives it. When the world size does not divide
the data set, the sampler pads the shards with copies of the first samples, so that every rank
gets as many: those copies must not be counted. Write `local_sums` (this rank's correct count,
sample count and loss sum, padding left out) and `exact_metrics` (the totals over all ranks, then
one division). The check evaluates the same model in one process on data sets of 13, 7 and 1,001
samples (none divisible by 2, 3 or 4; the last takes several batches per rank) and compares.

Run it with 4 processes:
    make lab CH=10 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/10_dist_eval.py)
"""
# SOLUTION FILE

import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.data import digits

SIZES = (13, 7, 1001)  # none is divisible by 2, 3 or 4: some shards are padded; the last needs several batches
BATCH = 32


def eval_loader(dataset: TensorDataset) -> DataLoader:
    """This rank's shard, in a fixed order. DistributedSampler pads the index list 0..N-1 with
    0, 1, 2, ... up to a multiple of world_size; rank r gets the positions r, r + W, r + 2W, ..."""
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))


# --- Your part ------------------------------------------------------------------------------------


def local_sums(model: nn.Module, loader: DataLoader, n_samples: int, device: torch.device) -> torch.Tensor:
    """A float64 tensor [correct, count, loss_sum] over this rank's *real* samples.

    The k-th sample this rank sees sits at position rank + k * world_size of the sampler's padded
    list; a position >= n_samples is a padding copy: leave it out of all three sums.
    loss_sum is the sum of the per-sample cross-entropy losses (F.cross_entropy(..., reduction="none"))."""
    # HINT 1: k counts this rank's samples across all its batches, not within one batch: keep a running count of the samples already seen; evaluate as for a test (model.eval(), no gradients)
    # HINT 2: positions = rank + world_size * torch.arange(seen, seen + len(y)); real = positions < n_samples; add (logits.argmax(1) == y)[real].sum(), real.sum() and F.cross_entropy(logits, y, reduction="none")[real].sum()
    # BEGIN SOLUTION: return float64 [correct, count, loss_sum] over this rank's real samples only (every padding copy left out), loss_sum being the sum of the per-sample cross-entropy losses
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    seen = 0
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            positions = rank + world_size * torch.arange(seen, seen + len(y), device=device)
            real = positions < n_samples
            seen += len(y)
            losses = F.cross_entropy(logits, y, reduction="none")
            sums[0] += (logits.argmax(dim=1) == y)[real].sum()
            sums[1] += real.sum()
            sums[2] += losses[real].double().sum()
    return sums
    # END SOLUTION


def exact_metrics(sums: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean loss) over all ranks' samples, the same on every rank, from each rank's
    [correct, count, loss_sum]."""
    # HINT 1: ratios do not add up over shards of unequal sizes: add up the numerators and the count over the ranks, then divide once
    # HINT 2: totals = sums.clone(); dist.all_reduce(totals, op=dist.ReduceOp.SUM); correct / count and loss_sum / count
    # BEGIN SOLUTION: return (accuracy, mean loss) over every rank's real samples, the same on every rank, leaving `sums` unchanged
    totals = sums.clone()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    correct, count, loss_sum = totals.tolist()
    return correct / count, loss_sum / count
    # END SOLUTION


# --- The check: the same evaluation in one process ------------------------------------------------


def trained_model() -> nn.Module:
    """A linear classifier with dropout, trained for a few full-batch steps: about 80% right, so the
    ranks' shards differ in accuracy (the same model on every rank: seeded, same data). It is left
    in training mode, as after a training epoch: evaluating it so would drop inputs at random."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, 10))
    x, y = digits().tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(15):
        optimizer.zero_grad()
        F.cross_entropy(model(x[1001:]), y[1001:]).backward()  # trained on the other samples
        optimizer.step()
    return model


def per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct (0/1) and loss of every sample, in one process, one batch (float64)."""
    model = copy.deepcopy(model).cpu().eval()
    with torch.no_grad():
        logits = model(x)
        return (logits.argmax(dim=1) == y).double(), F.cross_entropy(logits, y, reduction="none").double()


def mistakes(correct: torch.Tensor, losses: torch.Tensor, world_size: int, rank: int,
             several_batches: bool) -> dict[str, tuple[float, float]]:
    """What the classic mistakes would report: (accuracy, mean loss) of each."""
    n = len(correct)
    padded = torch.arange(-(-n // world_size) * world_size) % n  # the sampler's list, padding included
    per_rank = len(padded) // world_size
    shards = [torch.arange(r, n, world_size) for r in range(world_size)]  # real samples only
    own = [(correct[s].mean().item(), losses[s].mean().item()) for s in shards]
    mine = padded[rank::world_size]
    k = torch.arange(per_rank)

    def kept(positions_of) -> tuple[float, float]:
        """Every rank keeps the samples whose (wrongly computed) position is below n."""
        picks = torch.cat([padded[r::world_size][positions_of(r) < n] for r in range(world_size)])
        return correct[picks].mean().item(), losses[picks].mean().item()

    sums = torch.stack([torch.stack([correct[s].sum(), torch.tensor(float(len(s))), losses[s].sum()])
                        for s in shards])
    biggest = sums.max(0).values
    found = {}
    if several_batches:  # only a rank with several batches can show a missing running offset
        found["no offset"] = kept(lambda r: r + world_size * (k % BATCH))
    found.update({
        "padded": (correct[padded].mean().item(), losses[padded].mean().item()),
        "no rank": kept(lambda r: world_size * k),
        "contiguous": kept(lambda r: r * per_rank + k),
        "count with padding": (correct.sum().item() / len(padded), losses.sum().item() / len(padded)),
        "averaged": (sum(a for a, _ in own) / world_size, sum(b for _, b in own) / world_size),
        "max": ((biggest[0] / biggest[1]).item(), (biggest[2] / biggest[1]).item()),
        "local": (correct[mine].mean().item(), losses[mine].mean().item()),
        "local real": own[rank],
    })
    return found


def check_metrics(checks: Checks, model: nn.Module, dataset: TensorDataset, accuracy: float, loss: float,
                  still_training: bool, one_batch_sizes_passed: bool) -> None:
    rank, world_size, n = dist.get_rank(), dist.get_world_size(), len(dataset)
    correct, losses = per_sample(model, *dataset.tensors)
    ref_accuracy, ref_loss = correct.mean().item(), losses.mean().item()
    if not (math.isfinite(accuracy) and math.isfinite(loss)):
        checks.fail(f"{n} samples on {world_size} ranks: accuracy {accuracy}, mean loss {loss} - not a number: "
                    f"a division by a count of 0 (is the count added up?) or a NaN loss")
        return
    # Tolerances: the accuracy is a ratio of whole numbers, computed exactly in float64 both ways
    # (1e-12); per-sample float32 losses may differ in their last bit between batchings, and the
    # float64 sums in their order: 1e-6 on a mean loss of about 1 (the mistakes move it > 1e-5).
    acc_ok, loss_ok = abs(accuracy - ref_accuracy) <= 1e-12, abs(loss - ref_loss) <= 1e-6
    if acc_ok and loss_ok:
        checks.expect(True, "")
        return
    size = -(-n // world_size) * world_size
    hints = {
        "no offset": ("the padding copies were left out only in each rank's first batch: the position of "
                      "a sample continues across batches - count the samples already seen and add them to k"),
        "padded": f"you counted the padded duplicates: DistributedSampler repeats {size - n} sample(s) so every "
                  f"rank gets as many - leave out positions >= {n} (position = rank + k * world_size, k counted "
                  f"across all of this rank's batches)",
        "no rank": "the positions leave out the rank: the k-th sample of rank r sits at r + k * world_size",
        "contiguous": "the positions assume contiguous shards (rank * shard size + k): DistributedSampler "
                      "strides, so the k-th sample of rank r sits at r + k * world_size",
        "count with padding": "the count includes the padding copies while correct and loss_sum leave them out - "
                              "count only the real samples",
        "averaged": "you averaged the per-rank accuracies, but the shards have unequal sizes - add up "
                    "correct, count and loss_sum over ranks first, then divide once",
        "max": "that is the largest rank's share - all_reduce with ReduceOp.SUM, not MAX",
        "local": "that is this rank's own shard only - all_reduce the sums over all ranks",
        "local real": "that is this rank's own shard only - all_reduce the sums over all ranks",
    }
    index = 0 if not acc_ok else 1
    several_batches = n > BATCH * world_size and one_batch_sizes_passed
    fits = [name for name, values in mistakes(correct, losses, world_size, rank, several_batches).items()
            if abs(values[index] - (accuracy, loss)[index]) <= (1e-12 if index == 0 else 1e-6)]
    if "no offset" in fits:  # the smaller sizes passed: the rank and the padding are right within a batch
        hint = hints["no offset"]
    elif fits:  # several mistakes give the same numbers here: name each
        hint = "; or ".join(dict.fromkeys(hints[name] for name in fits))
    else:
        if still_training:
            hint = ("the model was still in training mode, so dropout changed its answers: call model.eval() "
                    "before evaluating")
        else:
            hint = ("add up [correct, count, loss_sum] of the real samples (per-sample losses, "
                    "reduction='none'), all_reduce them, divide once")
    what = "accuracy" if not acc_ok else "mean loss"
    got, expected = (accuracy, ref_accuracy) if not acc_ok else (loss, ref_loss)
    checks.fail(f"{n} samples on {world_size} ranks: {what} {got:.6f}, a single process says "
                f"{expected:.6f}: {hint}")


def main(me: Rank, checks: Checks) -> None:
    model = trained_model().to(me.device)
    x, y = digits().tensors
    for n in SIZES:
        dataset = TensorDataset(x[:n], y[:n])
        model.train()  # as a training loop leaves it
        sums = local_sums(model, eval_loader(dataset), n, me.device)
        still_training = model.training
        if not (torch.is_tensor(sums) and sums.shape == (3,) and sums.dtype == torch.float64):
            checks.fail(f"local_sums returned {type(sums).__name__} {getattr(sums, 'dtype', '')} "
                        f"{tuple(getattr(sums, 'shape', ()))}: return one float64 tensor [correct, count, loss_sum] "
                        f"(float32 sums of 1,001 losses lose digits)")
            return
        kept = sums.clone()
        accuracy, loss = exact_metrics(sums)
        if not torch.equal(kept, sums):
            checks.fail("exact_metrics changed its argument `sums` in place (an all_reduce on it): all_reduce "
                        "a copy (sums.clone()), so that the caller's per-rank sums stay per-rank")
        print0(f"{n} samples on {me.world_size} ranks: accuracy {accuracy:.4f}, mean loss {loss:.4f}")
        check_metrics(checks, model, dataset, accuracy, loss, still_training, not checks.failures)


if __name__ == "__main__":
    run_lab(main, title="Lab 10 (dist_eval)")
