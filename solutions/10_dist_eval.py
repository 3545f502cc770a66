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

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SIZES = (13, 7, 1001)  # none is divisible by 2, 3 or 4: some shards are padded; the last needs several batches
BATCH = 32


def eval_loader(dataset: TensorDataset) -> DataLoader:
    """This rank's shard, in a fixed order. DistributedSampler pads the index list 0..N-1 with
    0, 1, 2, ... up to a multiple of world_size; rank r gets the positions r, r + W, r + 2W, ..."""
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))


# --- Your part ------------------------------------------------------------------------------------


def local_sums(model: nn.Module, loader: DataLoader, n_samples: int, device: torch.device) -> torch.Tensor:
    """This rank's [correct, count, loss_sum], one float64 tensor, over its *real* samples only.

    `loader` gives this rank's shard of a data set of `n_samples`, padded by DistributedSampler (see
    eval_loader): no padding copy may count in any of the three sums. correct: how many real samples
    the model classifies right; count: how many real samples; loss_sum: the sum of their per-sample
    cross-entropy losses. Evaluate as for a test. No communication here: exact_metrics adds up."""
    # HINT 1: evaluate as for a test: model.eval() (dropout off) and torch.no_grad(). A sample is a padding copy when its position in the sampler's padded list is >= n_samples
    # HINT 2: the k-th sample of this rank sits at position rank + k * world_size, k counted across all of its batches (not restarted in each): keep a count of the samples already seen
    # HINT 3: positions = rank + world_size * torch.arange(seen, seen + len(y)); real = positions < n_samples; add (logits.argmax(1) == y)[real].sum(), real.sum() and F.cross_entropy(logits, y, reduction="none")[real].double().sum() into a float64 torch.zeros(3)
    # BEGIN SOLUTION: return this rank's float64 [correct, count, loss_sum] over its real samples only (no padding copy in any of the three), loss_sum being the sum of per-sample cross-entropy losses
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
    """(accuracy, mean loss) over the real samples of all ranks, the same on every rank, from each
    rank's [correct, count, loss_sum]. The caller keeps `sums` as this rank's own: leave it as it is."""
    # HINT 1: ratios do not add up over shards of unequal sizes: add up the numerators and the count over the ranks, then divide once
    # HINT 2: all_reduce works in place, on the tensor it is given: totals = sums.clone(); dist.all_reduce(totals, op=dist.ReduceOp.SUM); then correct / count and loss_sum / count
    # BEGIN SOLUTION: return (accuracy, mean loss) over all ranks' real samples, the same on every rank
    totals = sums.clone()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    correct, count, loss_sum = totals.tolist()
    return correct / count, loss_sum / count
    # END SOLUTION


if __name__ == "__main__":  # the check is in checks/lab10.py: you need not read it
    from checks import lab10
    lab10.run(SIZES=SIZES, BATCH=BATCH, eval_loader=eval_loader, local_sums=local_sums,
              exact_metrics=exact_metrics)
