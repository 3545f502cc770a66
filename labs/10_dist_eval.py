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
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/10_dist_eval.py; edit that one.)

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
    # (stuck? `make hint CH=10` prints hint 1 of 3; run it again for the next)
    # TODO: return this rank's float64 [correct, count, loss_sum] over its real samples only (no padding copy in any of the three), loss_sum being the sum of per-sample cross-entropy losses
    raise NotImplementedError("the TODO above")


def exact_metrics(sums: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean loss) over the real samples of all ranks, the same on every rank, from each
    rank's [correct, count, loss_sum]. The caller keeps `sums` as this rank's own: leave it as it is."""
    # (stuck? `make hint CH=10` prints hint 1 of 2; run it again for the next)
    # TODO: return (accuracy, mean loss) over all ranks' real samples, the same on every rank
    raise NotImplementedError("the TODO above")


if __name__ == "__main__":  # the check is in checks/lab10.py: you need not read it
    from checks import lab10
    lab10.run(SIZES=SIZES, BATCH=BATCH, eval_loader=eval_loader, local_sums=local_sums,
              exact_metrics=exact_metrics)
