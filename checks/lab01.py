"""The check of lab 01 (dp_to_ddp): it runs the code of labs/01_dp_to_ddp.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import multiprocessing
import os
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ringside import Checks, pick_backend, run_lab
from ringside.compare import all_gather_tensor, flat_params, max_diff
from ringside.data import digits
from ringside.effects import device_problem, misplaced_result, passed_on_every_rank, rank_gpu
from ringside.lab import captured_stdout, ranks_count, ranks_label

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The check: the same training in one process, on the same global batches ----------------------


class RecordingDataset(Dataset):
    """The digits, noting the index of every sample this rank fetches. The log is in shared memory,
    so DataLoader worker processes (num_workers > 0) write into the same log."""

    def __init__(self, base):
        self.base = base
        self.log = torch.full((4 * lab.EPOCHS * len(base),), -1, dtype=torch.int64).share_memory_()
        self.count = multiprocessing.get_context("fork").Value("q", 0)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        with self.count.get_lock():
            slot = self.count.value
            self.count.value += 1
        if slot < len(self.log):
            self.log[slot] = int(index)
        return self.base[index]

    def by_epoch(self, per_epoch: int) -> list[list[int]]:
        seen = self.log[:min(self.count.value, len(self.log))].tolist()
        return [seen[i:i + per_epoch] for i in range(0, len(seen), per_epoch)] if per_epoch else []


def reference_weights(dataset, world_size: int) -> torch.Tensor:
    """One process, the same initial model, each step on the global batch: the union of every
    rank's batch at that step (PyTorch's own DistributedSampler says which samples those are)."""
    model, loss_fn = lab.make_model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lab.LR)
    x_all, y_all = dataset.tensors
    for epoch in range(lab.EPOCHS):
        shards = reference_shards(epoch, world_size)
        for start in range(0, len(shards[0]), lab.BATCH_PER_RANK):
            batch = torch.tensor([i for shard in shards for i in shard[start:start + lab.BATCH_PER_RANK]])
            optimizer.zero_grad()
            loss_fn(model(x_all[batch]), y_all[batch]).backward()
            optimizer.step()
    return flat_params(model)


def join_group(checks: Checks) -> torch.device | None:
    """setup(); where it asks for NCCL or a GPU that this machine lacks, the diagnosis says so
    (PyTorch's own error speaks of drivers, not of pick_backend())."""
    try:
        return lab.setup()
    except Exception as error:
        backend, device_type = pick_backend()
        asked_for_gpu = any(word in str(error).lower() for word in ("nccl", "cuda", "nvidia", "gpu"))
        if device_type == "cuda" or not asked_for_gpu:
            raise
        checks.fail(f"setup() asked for NCCL or a GPU and failed ({type(error).__name__}), but this machine "
                    f"runs {backend} on the {device_type} - take the backend and device type from pick_backend()")
        return None


def check_setup(checks: Checks, device) -> bool:
    """setup() joined the group and returned the device this rank should compute on."""
    if not checks.expect(dist.is_initialized(), "setup() returned without joining the process group - call "
                                                "dist.init_process_group"):
        return False
    backend, device_type = dist.get_backend(), pick_backend()[1]
    wanted = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device_type == "cuda" else torch.device("cpu")
    if not isinstance(device, torch.device):
        shown = repr(device) if isinstance(device, str) else f"a {type(device).__name__}"
        how = "its .device" if isinstance(getattr(device, "device", None), torch.device) else "device_for() makes it"
        return checks.expect(False, f"setup() returned {shown}, not a torch.device - return the torch.device this "
                                    f"rank computes on, here {wanted!r} ({how})")
    if device.type == wanted.type == "cpu":
        how = "a CPU has no index: every rank computes on torch.device('cpu') (device_for() does this)"
    else:
        how = "take the device type from pick_backend() and the GPU index from LOCAL_RANK"
    ok = checks.expect(device == wanted, f"setup() returned {device!r} with backend {backend}; this rank should "
                                         f"compute on {wanted} - {how}")
    check_timeout(checks)  # named, but no reason to stop: training shows the other steps
    return ok


def check_timeout(checks: Checks) -> None:
    """The group has a timeout of its own: with PyTorch's default, a rank that never arrives keeps the
    others waiting 30 minutes (10 on NCCL) before anything is reported."""
    backend = dist.get_backend()
    try:  # private API: where a PyTorch version lacks it, this check is skipped
        group = dist.distributed_c10d._get_default_group()
        timeout = group._get_backend(torch.device("cuda" if backend == "nccl" else "cpu")).options._timeout
        default = dist.distributed_c10d._get_default_timeout(backend)
    except Exception:
        return
    checks.expect(timeout < default,
                  f"setup() joined the group with PyTorch's default timeout of {timeout}: a rank that never "
                  f"arrives keeps the others waiting that long - pass init_process_group a timeout "
                  f"(timedelta(seconds=30))")


def sampler_of(loader: DataLoader):
    """The sampler that orders the loader's samples: its `sampler`, or the one inside its batch_sampler
    (DataLoader(dataset, batch_sampler=BatchSampler(DistributedSampler(...), ...)) is right too)."""
    inner = getattr(loader.batch_sampler, "sampler", None)
    if not isinstance(loader.sampler, DistributedSampler) and isinstance(inner, DistributedSampler):
        return inner
    return loader.sampler


def batch_size_of(loader: DataLoader) -> int | None:
    """The number of samples per batch, given as batch_size= or by a batch_sampler."""
    return loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)


def check_loader(checks: Checks, loader: DataLoader, dataset: Dataset) -> bool:
    """The sampler's and loader's settings, read directly: each has its own classic mistake."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sampler = sampler_of(loader)
    if not isinstance(sampler, DistributedSampler):
        if loader.dataset is not dataset:  # split by hand (a Subset, a slice): each rank shuffles alone
            return checks.expect(False, f"the DataLoader reads {len(loader.dataset)} of the {len(dataset)} samples with a "
                                        f"{type(sampler).__name__}: a split by hand does not shuffle all the data in one order "
                                        f"with SEED, nor anew each epoch - give it the whole dataset and "
                                        f"sampler=DistributedSampler(dataset, shuffle=True, seed=SEED)")
        return checks.expect(False, f"the DataLoader samples with a {type(sampler).__name__}, so every rank would "
                                    f"train on the same samples - give it sampler=DistributedSampler(dataset, "
                                    f"shuffle=True, seed=SEED)")
    ok = True
    if (sampler.num_replicas, sampler.rank) != (world_size, rank):
        ok = checks.expect(False, f"the DistributedSampler was told num_replicas={sampler.num_replicas}, "
                                  f"rank={sampler.rank}, but this is rank {rank} of {world_size} - leave both out "
                                  f"(it reads them from the group)")
    if not sampler.shuffle:
        ok = checks.expect(False, "the DistributedSampler has shuffle=False: every epoch visits the samples in "
                                  "index order - pass shuffle=True")
    if sampler.seed != lab.SEED and sampler.seed == 0 and lab.SEED != 0:
        ok = checks.expect(False, f"the DistributedSampler's seed is 0, its default, not SEED={lab.SEED}: seed= was "
                                  f"left out - pass seed=SEED, so the shuffle is the one you chose (and the same "
                                  f"on every rank)")
    elif sampler.seed != lab.SEED:
        ok = checks.expect(False, f"the DistributedSampler's seed is {sampler.seed}, not SEED={lab.SEED} - every rank "
                                  f"must shuffle with the same seed (seed + rank splits nothing: the ranks' "
                                  f"shares overlap)")
    batch_size = batch_size_of(loader)
    if batch_size != lab.BATCH_PER_RANK:
        if batch_size == lab.BATCH_PER_RANK * world_size:
            hint = (f"that is the global batch: each rank's DataLoader takes BATCH_PER_RANK, and the "
                    f"{ranks_count(world_size)} together make the global batch of {lab.BATCH_PER_RANK * world_size}")
        elif batch_size == lab.BATCH_PER_RANK // world_size:
            hint = ("you divided the batch by world_size: the sampler already splits the data, and "
                    "BATCH_PER_RANK is each rank's batch")
        else:
            hint = "each rank's DataLoader takes batch_size=BATCH_PER_RANK (the batch per rank)"
        ok = checks.expect(False, f"the DataLoader's batch size is {batch_size}, expected "
                                  f"BATCH_PER_RANK={lab.BATCH_PER_RANK}: {hint}")
    return ok


def wrapped_model(checks: Checks, device: torch.device) -> nn.Module | None:
    """wrap(make_model()); DDP's refusal of device_ids for a CPU model is named in the lab's terms."""
    try:
        return lab.wrap(lab.make_model(), device)
    except ValueError as error:
        if device.type != "cpu" or "device_ids" not in str(error):
            raise
        checks.fail("wrap() gave DDP device_ids for a model on the CPU: device_ids=[i] names the one GPU the "
                    "model is on - on the CPU leave them out (device_ids=None)")
        return None


# --- Steps in train(): a collective that only some ranks call is named, not left to hang ----------

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
               "monitored_barrier", "all_gather_object", "gather_object", "broadcast_object_list",
               "scatter_object_list")


class RanksParted(Exception):
    """The ranks' next steps in train() differ; raised on every rank at the same step."""


class StepLedger:
    """While train() runs, every rank announces each step before it takes it: the batches of an
    epoch, a collective that train()'s code calls, an error, the end. The ranks compare their
    announcements on a group of their own, so when one rank calls a collective that the others do
    not, every rank learns it at once; otherwise that call would meet DDP's all-reduce or the
    check's own calls and hang or abort gloo without a word."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")

    def announce(self, step: str) -> None:
        steps = [None] * dist.get_world_size()
        # PyTorch's own function: dist.all_gather_object announces itself while collectives are watched
        dist.distributed_c10d.all_gather_object(steps, step, group=self.group)
        if len(set(steps)) > 1:
            raise RanksParted(parted_diagnosis(steps))

    def announcing(self, name: str, call):
        """`call`, announced as dist.<name>() before it runs."""
        def collective(*args, **kwargs):
            self.announce(f"dist.{name}()")
            return call(*args, **kwargs)
        return collective

    @contextmanager
    def watching_collectives(self):
        """dist.<collective> announces itself before it runs (calls written torch.distributed.x alike)."""
        originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, call in originals.items():
            setattr(dist, name, self.announcing(name, call))
        try:
            yield
        finally:
            for name, call in originals.items():
                setattr(dist, name, call)


class AnnouncingLoader:
    """The learner's loader, announcing to the ledger each time an epoch's batches begin."""

    def __init__(self, loader: DataLoader, ledger: StepLedger):
        self.loader, self.ledger, self.epoch = loader, ledger, 0

    def __iter__(self):
        self.ledger.announce(f"the batches of epoch {self.epoch}")
        self.epoch += 1
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def parted_diagnosis(steps: list[str]) -> str:
    """One line for every rank alike: which ranks took which step, and what to do about it."""
    by_step: dict[str, list[int]] = {}
    for rank, step in enumerate(steps):
        by_step.setdefault(step, []).append(rank)
    who = "; ".join(f"{ranks_label(ranks)}: {step}" for step, ranks in by_step.items())
    crashed = [rank for rank, step in enumerate(steps) if step.startswith("an error")]
    if crashed:
        return f"in train() the ranks' next steps differ ({who}) - fix the error of {ranks_label(crashed)} first"
    return (f"in train() the ranks' next steps differ ({who}): a collective that only some ranks call waits "
            f"forever for the others - call it on every rank, and put only the print under "
            f"if dist.get_rank() == 0")


def train_in_step(checks: Checks, model: nn.Module, loader: DataLoader, device: torch.device) -> bool:
    """train() with every step announced; False (with the diagnosis) where the ranks parted."""
    ledger = StepLedger()
    try:
        with ledger.watching_collectives():
            try:
                lab.train(model, AnnouncingLoader(loader, ledger), device)
            except RanksParted:
                raise
            except Exception as error:  # tell the others, who would wait for this rank until the timeout
                try:
                    ledger.announce(f"an error ({type(error).__name__})")
                except RanksParted:
                    pass
                raise
            ledger.announce("the end of training")
    except RanksParted as parted:
        return checks.expect(False, str(parted))
    return True


# --- What training left behind: the data each rank saw, the log, the weights ----------------------


def check_data(checks: Checks, seen: list[list[int]], sampler) -> bool:
    """Each epoch, the ranks' samples must split the data set; the order must change by epoch, the
    same way on every rank. Judged on every rank's record, so every rank reaches the same verdict."""
    world_size = dist.get_world_size()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (seen, getattr(sampler, "epoch", None)))
    seens, told = [s for s, _ in everyone], [t for _, t in everyone]
    if not checks.expect(all(len(s) == lab.EPOCHS for s in seens),
                         f"the ranks fetched samples for {[len(s) for s in seens]} epochs, expected {lab.EPOCHS}"):
        return False
    ok = True
    first_epoch = [set(s[0]) for s in seens]
    if world_size > 1 and all(s == first_epoch[0] for s in first_epoch):
        ok = checks.expect(False, "every rank trained on the same samples - give the DataLoader a DistributedSampler")
    elif sum(len(s) for s in first_epoch) != lab.SAMPLES or set().union(*first_epoch) != set(range(lab.SAMPLES)):
        ok = checks.expect(False, f"the ranks' samples do not split the {lab.SAMPLES} samples exactly - use "
                                  f"DistributedSampler (it gives rank r every world_size-th index of one "
                                  f"shuffled order)")
    # Judged by the orders each epoch used (what the sampler yielded then), not by the epoch the sampler
    # was last told: set_epoch(epoch) at the start and set_epoch(epoch + 1) at the end give the same orders.
    for epoch in range(lab.EPOCHS):
        used = [set(s[epoch]) for s in seens]
        if [set(shard) for shard in reference_shards(epoch, world_size)] == used:
            continue
        if len(set(told)) > 1:
            return checks.expect(False, f"in epoch {epoch} the ranks' samplers used different orders (last told the "
                                        f"epochs {told}, rank by rank), so their shares overlap - call "
                                        f"loader.sampler.set_epoch(epoch) on every rank, not under a rank condition")
        again = next((e for e in range(epoch) if [set(s[e]) for s in seens] == used), None)
        if again is not None:
            return checks.expect(False, f"epoch {epoch} took its samples in the same order as epoch {again}: the "
                                        f"sampler was not told the new epoch before its batches - call "
                                        f"loader.sampler.set_epoch(epoch) at the start of each epoch")
        return checks.expect(False, f"in epoch {epoch} the ranks' samples are not those of a DistributedSampler with "
                                    f"seed=SEED told set_epoch({epoch}) - call loader.sampler.set_epoch(epoch) at the "
                                    f"start of each epoch")
    return ok


def reference_shards(epoch: int, world_size: int) -> list[list[int]]:
    """What DistributedSampler(seed=SEED) gives each rank in `epoch` (the lab's data set size)."""
    samplers = [DistributedSampler(range(lab.SAMPLES), num_replicas=world_size, rank=rank, seed=lab.SEED)
                for rank in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


def check_logging(checks: Checks, printed: str) -> None:
    rank, lines = dist.get_rank(), printed.strip().splitlines()
    if rank != 0:
        checks.expect(not lines, f"printed {len(lines)} lines while training - log from rank 0 "
                                 f"only (if dist.get_rank() == 0: print(...))")
    elif not lines:
        checks.fail(f"rank 0 printed nothing while training, expected one loss line per epoch ({lab.EPOCHS}) - the "
                    f"print's condition must hold on rank 0: if dist.get_rank() == 0")
    else:
        checks.expect(len(lines) == lab.EPOCHS, f"printed {len(lines)} lines while training, expected one loss "
                      f"line per epoch ({lab.EPOCHS}) from rank 0 - print once per epoch, "
                      f"inside the epoch loop after its batches")


def check_weights(checks: Checks, model: nn.Module, dataset, against_reference: bool) -> None:
    """The weights agree on every rank and, where the data was right, with one process on the same
    global batches (where it was not, check_data has named the mistake already)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checks.expect(isinstance(model, DDP), f"wrap() returned a {type(model).__name__}, not a DistributedDataParallel"
                                          + unwrapped_hint(model))
    mine = flat_params(model)
    if not checks.expect(bool(torch.isfinite(mine).all()), "the weights are NaN or inf after training"):
        return
    copies = all_gather_tensor(mine.to(next(model.parameters()).device))
    if any(max_diff(mine, copy.cpu()) > 0 for copy in copies):
        checks.fail("after training the weights differ between ranks - without DDP each rank follows its own "
                    "gradients; wrap the model in DistributedDataParallel so they are averaged")
        return
    if not against_reference:
        return
    # The weights are equal on every rank now, so rank 0 alone runs the reference and shares the gap.
    # Tolerance: the same sums in another order differ by float32 rounding (about 1e-7 per step);
    # 120 steps leave under 1e-5. A real mistake (wrong data, no averaging) moves weights by > 1e-2.
    gap = [max_diff(mine, reference_weights(dataset, world_size)) if rank == 0 else None]
    dist.broadcast_object_list(gap, src=0)
    gap = gap[0]
    checks.expect(gap <= 1e-5, f"the weights differ from the single-process run on the same global batches by "
                               f"{gap:.2e} (tolerance 1e-5): the sampler, batch size and DDP look right, so "
                               f"compare the training loop and learning rate with the chapter's")


def unwrapped_hint(model: nn.Module) -> str:
    """Why a model that is not DDP does not average, for the two forms it takes."""
    if isinstance(model, nn.DataParallel):
        return " - DataParallel drives several devices from one process and averages nothing between ranks"
    return " - return the DDP wrapper itself (its .module is the bare model, which averages nothing)"


def agreed(ok: bool) -> bool:
    """True on every rank when it is True on every rank: the ranks go on or stop together (objects, not
    ringside.lab.everyone's tensor: setup() is the learner's, and the GPU it chose is not known here)."""
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, ok)
    return all(verdicts)


def main(checks: Checks) -> None:
    device = join_group(checks)
    if device is None or not check_setup(checks, device):
        return
    dataset = RecordingDataset(digits(n=lab.SAMPLES))
    loader = lab.make_loader(dataset)
    if not agreed(check_loader(checks, loader, dataset)):  # every rank stops (DDP would wait for the others)
        return
    model = wrapped_model(checks, device)
    if model is None:
        return
    with captured_stdout(echo=dist.get_rank() == 0) as printed:
        if not train_in_step(checks, model, loader, device):
            return
    data_ok = check_data(checks, dataset.by_epoch(len(sampler_of(loader))), sampler_of(loader))
    check_logging(checks, printed.getvalue())
    check_weights(checks, model, dataset.base, against_reference=data_ok)
    if passed_on_every_rank(checks):
        check_on_gpu(checks)


def check_on_gpu(checks: Checks) -> None:
    """setup, wrap and train once more as `make lab` runs them on a GPU machine: pick_backend() answers
    nccl and cuda, this rank's GPU is a stand-in (ringside.effects.rank_gpu) and so is DDP (its checks
    of devices, the inputs moved to device_ids[0]; no averaging: the run above compared the weights),
    on one batch per epoch. A device that is not the rank's GPU, a model never moved, a batch or a
    tensor left on the CPU is named."""
    with rank_gpu(lab.setup, lab.make_loader, lab.wrap, lab.train) as (gpu, _):
        device, problem = device_problem("setup", lab.setup)
        if problem is None and device != gpu.device:
            problem = (f"setup(), run as on a GPU machine (pick_backend() answers nccl and cuda), returned "
                       f"{device}, not this rank's GPU {gpu.device} - take the device type from pick_backend() and "
                       f"the GPU index from LOCAL_RANK (device_for() does both)")
        if problem is None:
            try:
                model, problem = device_problem("wrap", lab.wrap, lab.make_model(), gpu.device)
            except ValueError as error:  # DDP's refusal: device_ids for a model that is not on a GPU
                model, problem = None, (f"wrap(), run as on a GPU machine: DDP refused the model "
                                        f"({str(error).split(', but got')[0]}) - put it on `device` first "
                                        f"(model.to(device)), then wrap it")
            problem = problem or misplaced_result("wrap", list(model.parameters()), gpu.device, "the model",
                                                  "(`device`): put the model there (model.to(device)) before DDP "
                                                  "wraps it")
        if problem is None:
            loader = lab.make_loader(digits(n=lab.BATCH_PER_RANK * dist.get_world_size()))
            with captured_stdout(echo=False):
                _, problem = device_problem("train", lab.train, model, loader, gpu.device)
        checks.expect(problem is None, problem or "")


def too_many_ranks(world_size: int) -> str | None:
    """The lab's 480 samples make the same whole batches on every rank only up to 6 ranks."""
    if world_size > 6:
        return (f"its {lab.SAMPLES} samples split into whole batches of 8 on 1 to 6 ranks only, and the "
                "comparison with one process needs every rank to take the same steps: use --nproc-per-node 1 to 6")
    return None


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 01 (dp_to_ddp)", refuse=too_many_ranks, init=False)
