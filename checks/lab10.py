"""The check of lab 10 (dist_eval): it runs the code of labs/10_dist_eval.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.data import digits
from ringside.effects import device_problem, misplaced_result, passed_on_every_rank, rank_gpu

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


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


def readings(correct: torch.Tensor, losses: torch.Tensor, world_size: int) -> dict[str, torch.Tensor]:
    """[correct, count, loss_sum] of every rank (world_size x 3) under each reading of "the real
    samples": the right one and the classic wrong masks, plus ways of adding up a batch."""
    n = len(correct)
    padded = torch.arange(-(-n // world_size) * world_size) % n  # the sampler's list, padding included
    per_rank = len(padded) // world_size
    k = torch.arange(per_rank)  # k-th sample of a rank, counted across its batches
    masks = {
        "right": lambda r: r + world_size * k < n,
        "padded": lambda r: torch.ones(per_rank, dtype=torch.bool),
        "off by one": lambda r: r + world_size * k <= n,
        "no offset": lambda r: r + world_size * (k % lab.BATCH) < n,
        "contiguous": lambda r: r * per_rank + k < n,
    }
    rows = {name: [] for name in [*masks, "batches", "batch means", "batch means, padding in",
                                  "padded mean times count", "batch accuracies", "whole size"]}
    for r in range(world_size):
        mine = padded[r::world_size]
        for name, mask in masks.items():
            real = mask(r)
            rows[name].append([correct[mine][real].sum(), real.sum().double(), losses[mine][real].sum()])
        real = masks["right"](r)
        batches = [slice(start, start + lab.BATCH) for start in range(0, per_rank, lab.BATCH)]
        means = [(correct[mine][b][real[b]].mean(), losses[mine][b][real[b]].mean(), losses[mine][b].mean(),
                  real[b].sum()) for b in batches if real[b].any()]
        right = rows["right"][r]
        rows["batches"].append([right[0], torch.tensor(float(len(batches))), right[2]])
        rows["batch means"].append([right[0], right[1], sum(m[1] for m in means)])
        rows["batch means, padding in"].append([right[0], right[1], sum(m[2] for m in means)])
        rows["padded mean times count"].append([right[0], right[1], sum(m[2] * m[3] for m in means)])
        rows["batch accuracies"].append([sum(m[0] for m in means), right[1], right[2]])
        rows["whole size"].append([right[0], torch.tensor(float(n)), right[2]])
    return {name: torch.tensor([[float(v) for v in row] for row in table], dtype=torch.float64)
            for name, table in rows.items()}


def close(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Which of [correct, count, loss_sum] (columns) agree on every rank. Tolerances: correct and count
    are whole numbers (exact, 1e-9); per-sample float32 losses may differ in their last bit between
    batchings (a relative 1e-7 each): 1e-6 relative on a loss sum (the mistakes move it > 1e-4)."""
    tolerance = torch.tensor([1e-9, 1e-9, 0.0], dtype=torch.float64) + 1e-6 * expected.abs() * torch.tensor([0, 0, 1])
    return ((got - expected).abs() <= tolerance).all(dim=0)


def listed(column: torch.Tensor) -> str:
    return ", ".join(f"{v:g}" if v == int(v) else f"{v:.3f}" for v in column.tolist())


def local_sums_finding(table: torch.Tensor, correct: torch.Tensor, losses: torch.Tensor, n: int,
                       smaller_sizes_passed: bool) -> str | None:
    """What is wrong with every rank's [correct, count, loss_sum] (table: world_size x 3), or None.
    The same answer on every rank: it looks at all ranks' sums at once."""
    world_size = len(table)
    if not torch.isfinite(table).all():
        return (f"local_sums returned {listed(table.flatten())} (ranks in order): not a number - a NaN loss, "
                f"or a mean over a batch with no real sample (0 / 0)")
    ways = readings(correct, losses, world_size)
    right = ways["right"]
    if close(table, right).all():
        return None  # within the stated tolerance: a loss sum added up in float32 (4e-8 relative) passes too
    size = -(-n // world_size) * world_size
    whole = {  # mistakes that make all three sums wrong the same way
        # (positions without the rank, k * world_size, are all below n_samples: the same effect, the same words)
        "padded": f"you counted the padded duplicates: DistributedSampler repeats {size - n} sample(s) so every "
                  f"rank gets as many - leave out positions >= {n} (position = rank + k * world_size, k counted "
                  f"across all of this rank's batches)",
        "off by one": f"a sample at position {n} is a padding copy (the real ones sit at 0..{n - 1}): the mask "
                      f"must be positions < n_samples, not <=",
        "no offset": "the padding copies were left out only in each rank's first batch: the position of a sample "
                     "continues across batches - count the samples already seen and add them to k",
        "contiguous": "the positions assume contiguous shards (rank * shard size + k): DistributedSampler "
                      "strides, so the k-th sample of rank r sits at r + k * world_size",
    }
    if close(table, right.sum(0).expand(world_size, 3)).all():
        return ("every rank's local_sums returned the totals over all ranks (an all_reduce inside it?): it must "
                "return this rank's own sums - exact_metrics adds them up")
    fits = [name for name in whole if close(table, ways[name]).all()]
    if "no offset" in fits and n > lab.BATCH * world_size and smaller_sizes_passed:
        fits = ["no offset"]  # the one-batch sizes passed: the rank and the padding are right within a batch
    if fits:
        alike = (" (the two give the same sums when there is one padding copy, as always on 2 ranks: more ranks "
                 "tell them apart)" if {"padded", "off by one"} <= set(fits) else "")
        return "; or ".join(whole[name] for name in fits) + alike
    # One or two of the three sums are wrong: say which, and what each one looks like.
    names = ("correct", "the count", "loss_sum")
    ok = close(table, right)
    if ok[0] and ok[1] and not ok[2]:
        low = low_precision_finding(table, right)
        if low:
            return low
    mask_says = {
        "padded": "includes the padding copies (is the mask applied to it?)",
        "off by one": f"includes the sample at position {n}, a padding copy (the mask must be positions < n_samples)",
        "no offset": "leaves the padding out only in each rank's first batch (positions continue across batches)",
        "contiguous": "uses the positions of contiguous shards (DistributedSampler strides: r + k * world_size)",
    }
    other_says = {
        (1, "batches"): "is the number of batches, not of samples: add up how many real samples each batch has",
        (1, "whole size"): "is n_samples on every rank: count this rank's real samples only",
        (2, "batch means"): "is a sum of batch means: adding up batch means (reduction='mean', the default, or "
                            ".mean()) is not the sum over samples - add up the per-sample losses (reduction='none')",
        (2, "batch means, padding in"): "is a sum of batch means, padding copies in: adding up batch means "
                                        "(reduction='mean', the default) is not the sum over samples - add up the "
                                        "per-sample losses (reduction='none') of the real samples",
        (2, "padded mean times count"): "is each batch's mean loss times its count of real samples, but that "
                                        "mean includes the padding copies - add up the per-sample losses "
                                        "(reduction='none') of the real samples",
        (0, "batch accuracies"): "adds up batch accuracies (a mean per batch): add up the 0/1 correct of every "
                                 "real sample",
    }
    said, masked = [], False
    for column in range(3):
        if ok[column]:
            continue
        column_fits = [what for name, what in mask_says.items() if close(table, ways[name])[column]]
        if close(table, ways["padded"])[column] and ok.any():  # the mask is right for the others: not applied here
            column_fits = [mask_says["padded"]]
        masked = masked or bool(column_fits)
        column_fits += [what for (c, name), what in other_says.items() if c == column and close(table, ways[name])[c]]
        generic = {0: "count the real samples whose arg-max class is the label",
                   1: "count this rank's real samples",
                   2: "add up the per-sample cross-entropy losses (reduction='none') of the real samples"}[column]
        said.append(f"{names[column]} per rank is {listed(table[:, column])} where the real samples give "
                    f"{listed(right[:, column])}: {names[column]} " + ("; or ".join(column_fits) if column_fits
                                                                       else f"is off - {generic}"))
    fine = [names[c] for c in range(3) if ok[c]]
    if fine and masked:
        said.append(f"{' and '.join(fine)} {'is' if len(fine) == 1 else 'are'} right: leave the same samples out "
                    f"of all three sums")
    return "; ".join(said)


def low_precision_finding(table: torch.Tensor, right: torch.Tensor) -> str | None:
    """A loss sum off by more than the tolerance, that fits in float16's or bfloat16's few significant
    bits: added up in a 16-bit accumulator. (float32 accumulation of 1,001 losses stays within the
    tolerance, 1e-6 relative, and is accepted.)"""
    many = table[:, 1] >= 1  # a float32 or float64 sum fits in 16 bits only by a rare chance
    loss_sums = table[many, 2]
    for dtype, bits in ((torch.float16, 11), (torch.bfloat16, 8)):
        if len(loss_sums) and (loss_sums.to(dtype).double() == loss_sums).all():
            return (f"loss_sum is {loss_sums[0].item()!r} on rank {int(many.nonzero()[0])}, where float64 gives "
                    f"{right[many, 2][0].item()!r}: every rank's loss_sum fits in {str(dtype)[6:]}'s {bits} "
                    f"significant bits, so it was added up in {str(dtype)[6:]} and converted at the end, losing "
                    f"digits - add up in float64")
    return None


def exact_metrics_finding(table: torch.Tensor, rank: int, results: torch.Tensor) -> str | None:
    """Is this rank's (accuracy, mean loss) what all ranks' sums (table, whatever they are) give?
    results: every rank's (accuracy, mean loss), world_size x 2."""
    accuracy, loss = results[rank].tolist()
    if not (math.isfinite(accuracy) and math.isfinite(loss)):
        return (f"exact_metrics returned accuracy {accuracy}, mean loss {loss} - not a number: a division "
                f"by a count of 0 (is the count added up?) or a NaN loss")

    def ratios(sums: torch.Tensor) -> tuple[float, float]:
        return (sums[0] / sums[1]).item(), (sums[2] / sums[1]).item()

    def fits(expected: tuple[float, float]) -> bool:
        # Tolerances: the same float64 sums added up in another order: 1e-12 on ratios of about 1
        return all(abs(a - b) <= 1e-12 * max(1.0, abs(b)) for a, b in zip((accuracy, loss), expected))

    if fits(ratios(table.sum(0))):
        return None
    right = [r for r in range(len(table)) if all(abs(a - b) <= 1e-12 * max(1.0, abs(b))
                                                 for a, b in zip(results[r].tolist(), ratios(table.sum(0))))]
    per_rank = [ratios(row) for row in table]
    variants = {
        "you averaged the per-rank accuracies (and mean losses), but the shards have unequal sizes - add up "
        "correct, count and loss_sum over ranks first, then divide once":
            (sum(a for a, _ in per_rank) / len(table), sum(b for _, b in per_rank) / len(table)),
        "that is the largest rank's share - all_reduce with ReduceOp.SUM, not MAX": ratios(table.max(0).values),
        "that is this rank's own sums only - all_reduce the sums over all ranks (every rank needs the totals)":
            per_rank[rank],
    }
    named = [hint for hint, expected in variants.items() if fits(expected)]
    if right and not named:
        named = [f"{'rank' if len(right) == 1 else 'ranks'} {', '.join(map(str, right))} got the right numbers, "
                 f"this rank did not: every rank needs the totals - all_reduce (reduce gives them to one rank only)"]
    want = ratios(table.sum(0))
    return (f"exact_metrics returned accuracy {accuracy:.6f}, mean loss {loss:.6f}, but the sums of all ranks "
            f"give {want[0]:.6f}, {want[1]:.6f}: "
            + ("; or ".join(named) if named else "add up [correct, count, loss_sum] over all ranks (all_reduce, "
                                                 "SUM), then divide once"))


def main(me: Rank, checks: Checks) -> None:
    model = trained_model().to(me.device)
    x, y = digits().tensors
    first = None  # the verdict on the first size, (accuracy, loss), for the run on a GPU machine
    for n in lab.SIZES:
        dataset = TensorDataset(x[:n], y[:n])
        model.train()  # as a training loop leaves it
        dropout_on = []  # at every forward through a dropout layer during local_sums: was it in training mode?
        hooks = [m.register_forward_pre_hook(lambda module, args: dropout_on.append(module.training))
                 for m in model.modules() if isinstance(m, nn.Dropout)]
        try:
            sums = lab.local_sums(model, lab.eval_loader(dataset), n, me.device)
        finally:
            for hook in hooks:
                hook.remove()
        where = f"{n} samples on {me.world_size} ranks: "
        if not (torch.is_tensor(sums) and sums.shape == (3,) and sums.dtype == torch.float64):
            checks.fail(f"{where}local_sums returned {type(sums).__name__} {getattr(sums, 'dtype', '')} "
                        f"{tuple(getattr(sums, 'shape', ()))}: return one float64 tensor [correct, count, loss_sum] "
                        f"(float32 sums of 1,001 losses lose digits)")
            return
        if sums.device != me.device:  # on NCCL exact_metrics' all_reduce would refuse them
            checks.fail(f"{where}local_sums returned its sums on {sums.device}, but the data and the model are on "
                        f"{me.device}: NCCL's all_reduce (in exact_metrics) takes tensors on the rank's GPU only - "
                        f"make the sums where the data is")
            return
        # Every rank's sums and whether dropout was on, for a diagnosis that looks at all ranks at once.
        mine = torch.cat([sums.detach().to(me.device), torch.tensor([float(any(dropout_on))], dtype=torch.float64,
                                                                    device=me.device)])
        everyone = [torch.empty_like(mine) for _ in range(me.world_size)]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone).cpu()
        kept = sums.clone()
        try:
            result = lab.exact_metrics(sums)
        except NotImplementedError:
            raise
        except Exception as error:  # same on every rank: the totals are all-reduced before any division
            total = int(table[:, 1].sum().item())
            if total == n:
                raise
            correct, losses = per_sample(model, *dataset.tensors)
            if total == 0:
                finding = ("no sample was counted as real on any rank: are the positions shifted (the count of "
                           "samples seen increased before this batch's positions were computed?) or the mask "
                           "inverted?")
            else:
                finding = (local_sums_finding(table[:, :3], correct, losses, n, True) or
                           f"the counts of all ranks add up to {total}, not {n}: each real sample must be "
                           f"counted once, on exactly one rank")
            checks.fail(f"{where}{finding} (exact_metrics then raised {type(error).__name__}: {error} - a "
                        f"consequence, fix local_sums first)")
            return
        try:
            accuracy, loss = (float(value) for value in result)
        except (TypeError, ValueError, RuntimeError):
            checks.fail(f"{where}exact_metrics returned {result!r}: return two numbers, (accuracy, mean loss)")
            return
        print0(f"{where}accuracy {accuracy:.4f}, mean loss {loss:.4f}")
        first = first or (accuracy, loss)
        if table[:, 3].any():
            on = [r for r in range(me.world_size) if table[r, 3]]
            checks.fail(f"{where}dropout was active while local_sums evaluated (the model in training mode, on "
                        f"rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}): call model.eval() before "
                        f"evaluating (putting it back in training mode after the loop is fine)")
        else:
            correct, losses = per_sample(model, *dataset.tensors)
            finding = local_sums_finding(table[:, :3], correct, losses, n, not checks.failures)
            checks.expect(finding is None, f"{where}{finding}")
        results = [torch.empty(2, dtype=torch.float64, device=me.device) for _ in range(me.world_size)]
        dist.all_gather(results, torch.tensor([accuracy, loss], dtype=torch.float64, device=me.device))
        finding = exact_metrics_finding(table[:, :3], me.rank, torch.stack(results).cpu())
        checks.expect(finding is None, f"{where}{finding}")
        checks.expect(torch.equal(kept, sums), f"{where}exact_metrics changed its argument `sums` in place (an "
                      f"all_reduce on it): all_reduce a copy, so that the caller's per-rank sums stay per-rank")
        # Stop after the first size that failed on any rank (all ranks together: the next size has collectives).
        failed = torch.tensor([float(bool(checks.failures))], device=me.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            return
    if passed_on_every_rank(checks):
        check_on_gpu(checks, first)


def check_on_gpu(checks: Checks, expected: tuple[float, float]) -> None:
    """local_sums and exact_metrics once more as `make lab` runs them on a GPU machine: the model on this
    rank's stand-in GPU, NCCL's rules for what all_reduce accepts (ringside.effects.rank_gpu), on the
    smallest data set. Sums made on the CPU are named where they are made; the results must not change."""
    x, y = digits().tensors
    n, model = lab.SIZES[0], trained_model()
    with rank_gpu(lab.local_sums, lab.exact_metrics) as (gpu, _):
        model.to(gpu.device)
        sums, problem = device_problem("local_sums", lab.local_sums, model, lab.eval_loader(
            TensorDataset(x[:n], y[:n])), n, gpu.device)
        problem = problem or misplaced_result("local_sums", sums, gpu.device, "the sums it returned")
        if problem is None:
            result, problem = device_problem("exact_metrics", lab.exact_metrics, sums)
        if not checks.expect(problem is None, f"{n} samples on {dist.get_world_size()} ranks: {problem}"):
            return
        got = tuple(float(value) for value in result)
        checks.expect(all(abs(a - b) <= 1e-12 * max(1.0, abs(b)) for a, b in zip(got, expected)),
                      f"{n} samples on {dist.get_world_size()} ranks, on a GPU machine (this rank's GPU, "
                      f"{gpu.device}): exact_metrics returned {got}, on the CPU {expected}")


def one_rank_proves_nothing(world_size: int) -> str | None:
    """At one rank the classic mistakes give the right number: a pass would prove nothing."""
    if world_size == 1:
        return ("on one rank there is no padding and no other rank's sums, so the classic mistakes (counting "
                "the padded duplicates, averaging per-rank accuracies, reporting only your own sums) all give "
                "the right answer and a PASS would prove nothing: use --nproc-per-node 2 or more")
    return None


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 10 (dist_eval)", refuse=one_rank_proves_nothing)
