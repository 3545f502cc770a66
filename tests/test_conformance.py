"""Every mechanism the course builds by hand agrees with PyTorch's own, on generated cases.

The solutions' ring all-reduce (lab 04), home-made DDPs (labs 04 and 12), sharded Adam (lab 13),
sampler (06), synchronized BatchNorm (07), loss scaler (09), exact evaluation (10), DiLoCo's outer step
(17) and gradient noise scale (18) are run on models and sizes the labs never use - world sizes 1 to 5,
sizes that do not divide, frozen, tied and unused parameters, buffers, ranks that start from different
weights, bucket caps from one element to everything, accumulation windows, subgroups - and compared with
DistributedDataParallel, torch.optim.Adam and AdamW, DistributedSampler, BatchNorm on the gathered batch,
GradScaler, a one-process evaluation, torch.optim.SGD(nesterov=True) and a direct float64 computation.
hypothesis draws the cases from a fixed seed
(derandomize) and a bounded number of examples, so the suite is fast and the same on every run.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ringside import run_ranks
from ringside.launch import ROOT


def generated(examples: int):
    """hypothesis settings: the same cases on every run, none of them timed."""
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def solution(stem: str):
    """solutions/<stem>.py as a module (in whichever process calls it: a rank loads its own copy)."""
    spec = importlib.util.spec_from_file_location(f"solution_{stem}", ROOT / "solutions" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


# --- Models unlike the labs': frozen, tied and unused parameters, buffers ------------------------

model_specs = st.fixed_dictionaries({
    "widths": st.lists(st.integers(1, 9), min_size=1, max_size=3),  # hidden layer widths
    "frozen": st.booleans(),   # the first layer's bias does not train
    "tied": st.booleans(),     # a square layer used twice (one weight, two uses)
    "norm": st.booleans(),     # a BatchNorm: running statistics are buffers
    "unused": st.booleans(),   # a layer forward never calls
})


class Generated(nn.Module):
    """A small network built from a spec; `seed` differs per rank, so only the wrapper's broadcast
    makes the ranks start equal."""

    def __init__(self, spec: dict, seed: int, features: int = 5, outputs: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        sizes = [features, *spec["widths"]]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.twice = nn.Linear(sizes[-1], sizes[-1]) if spec["tied"] else None
        self.norm = nn.BatchNorm1d(sizes[-1]) if spec["norm"] else None
        self.head = nn.Linear(sizes[-1], outputs)
        self.spare = nn.Linear(outputs, outputs) if spec["unused"] else None
        if spec["frozen"]:
            self.layers[0].bias.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.twice is not None:
            x = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x)


def rank_batch(rank: int, step: int, batch: int = 6, features: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, features, generator=g), torch.randn(batch, 3, generator=g)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """Every trained parameter's gradient; None (never used) reads as zeros."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for p in model.parameters() if p.requires_grad]


def state_of(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def reference_ddp(spec: dict, rank: int, steps: list[int], accumulate: int = 1) -> list:
    """torch's DDP (find_unused_parameters where the spec has an unused layer): the state after
    construction, then per window the averaged gradients and the state after SGD's step."""
    model = DDP(Generated(spec, seed=rank), find_unused_parameters=spec["unused"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = [state_of(model.module)]
    for step in steps:
        for micro in range(accumulate):
            x, y = rank_batch(rank, step * accumulate + micro)
            syncing = micro == accumulate - 1
            with (model.no_sync() if not syncing else _nothing()):
                nn.functional.mse_loss(model(x), y).backward()
        history.append(grads_of(model.module))
        optimizer.step()
        optimizer.zero_grad()
        history.append(state_of(model.module))
    return history


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def compare_histories(mine: list, theirs: list) -> str | None:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        for j, (x, y) in enumerate(zip(a, b)):
            if not close(x, y):
                return f"entry {i} (0: start, odd: gradients, even: after a step), tensor {j}: {x} vs {y}"
    return None if len(mine) == len(theirs) else f"{len(mine)} entries vs {len(theirs)}"


# --- Lab 04: the ring, and average_gradients as a home-made DDP -----------------------------------


def ring_vs_all_reduce(rank: int, world_size: int, numels: list[int], dtype) -> list[str]:
    lab = solution("04_ring_allreduce")
    wrong = []
    for numel in numels:
        g = torch.Generator().manual_seed(numel * 10 + rank)
        mine = (torch.randn(numel, generator=g) * 100).to(dtype)
        theirs = mine.clone()
        lab.ring_all_reduce(mine)
        dist.all_reduce(theirs)
        if not close(mine, theirs, rtol=1e-5 if dtype.is_floating_point else 0, atol=1e-3):
            wrong.append(f"{numel} elements of {dtype}")
    return wrong


@generated(examples=12)
@given(world_size=st.integers(1, 5), numels=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]))
def test_ring_all_reduce_equals_dist_all_reduce(world_size, numels, dtype):
    results = run_ranks(ring_vs_all_reduce, world_size, numels, dtype, show_output=False, timeout=60)
    assert results == [[]] * world_size, results


def home_ddp_vs_ddp(rank: int, world_size: int, spec: dict, steps: int) -> str | None:
    lab = solution("04_ring_allreduce")
    model = Generated(spec, seed=rank)
    lab.broadcast_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # DDP re-broadcasts rank 0's buffers at every training forward; lab 04's DDP does not, so only
    # the parameters are compared after the start (BatchNorm trains on batch statistics anyway).
    mine = [state_of(model)]
    for step in range(steps):
        x, y = rank_batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        lab.average_gradients(model)
        mine.append(grads_of(model))
        optimizer.step()
        optimizer.zero_grad()
        mine.append([p.detach().clone() for p in model.parameters()])
    theirs = reference_ddp(spec, rank, list(range(steps)))
    theirs = [theirs[0]] + [t if i % 2 else t[:len(list(model.parameters()))]
                            for i, t in enumerate(theirs[1:], start=1)]
    return compare_histories(mine, theirs)


@generated(examples=10)
@given(world_size=st.integers(1, 5), spec=model_specs)
def test_lab04_home_ddp_equals_ddp(world_size, spec):
    results = run_ranks(home_ddp_vs_ddp, world_size, spec, 2, show_output=False, timeout=60)
    assert results == [None] * world_size, results


# --- Lab 12: HandDDP, buckets, overlap and no_sync ------------------------------------------------


def hand_ddp_vs_ddp(rank: int, world_size: int, spec: dict, cap_fraction: float, accumulate: int) -> str | None:
    lab = solution("12_ddp_internals")
    model = Generated(spec, seed=rank)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hand = lab.HandDDP(model, bucket_cap=max(1, round(cap_fraction * total)))  # 1 element .. everything
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.1)
    mine = [state_of(model)]
    for step in range(2):
        for micro in range(accumulate):
            x, y = rank_batch(rank, step * accumulate + micro)
            with (hand.no_sync() if micro < accumulate - 1 else _nothing()):
                nn.functional.mse_loss(hand(x), y).backward()
        hand.finish_gradient_sync()
        mine.append(grads_of(model))
        optimizer.step()
        optimizer.zero_grad()
        mine.append(state_of(model))
    return compare_histories(mine, reference_ddp(spec, rank, [0, 1], accumulate))


@generated(examples=14)
@given(world_size=st.integers(1, 5), spec=model_specs, cap_fraction=st.floats(0.0, 1.2),
       accumulate=st.integers(1, 3))
def test_lab12_hand_ddp_equals_ddp(world_size, spec, cap_fraction, accumulate):
    results = run_ranks(hand_ddp_vs_ddp, world_size, spec, cap_fraction, accumulate, show_output=False,
                        timeout=60)
    assert results == [None] * world_size, results


def no_sync_decided_at_forward(rank: int, world_size: int) -> list[bool]:
    """For DDP, then HandDDP: are the gradients averaged (equal on every rank) after a backward whose
    forward ran inside no_sync() (backward outside), and after one whose forward ran outside (backward
    inside)? DDP decides at the forward: [False, True]."""
    lab = solution("12_ddp_internals")
    averaged = []
    for wrap in (DDP, lab.HandDDP):
        for forward_inside in (True, False):
            torch.manual_seed(0)
            model = wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
            x = torch.full((3, 4), float(rank + 1))  # other data on every rank: other gradients
            if forward_inside:
                with model.no_sync():
                    loss = model(x).sum()
                loss.backward()
            else:
                loss = model(x).sum()
                with model.no_sync():
                    loss.backward()
            if isinstance(model, lab.HandDDP) and model.pending:
                model.finish_gradient_sync()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            copies = [torch.empty_like(grads) for _ in range(world_size)]
            dist.all_gather(copies, grads)
            averaged.append(all(torch.equal(c, copies[0]) for c in copies))
    return averaged


def test_lab12_no_sync_is_decided_at_the_forward_as_in_ddp():
    ddp_forward_inside, ddp_forward_outside, hand_inside, hand_outside = run_ranks(
        no_sync_decided_at_forward, 2, show_output=False, timeout=60)[0]
    assert (ddp_forward_inside, ddp_forward_outside) == (False, True)  # PyTorch's behaviour, measured
    assert (hand_inside, hand_outside) == (ddp_forward_inside, ddp_forward_outside)


# --- Lab 13: the sharded Adam (ZeRO-1) against torch.optim.Adam / AdamW ----------------------------


def sharded_vs_adamw(rank: int, world_size: int, shapes: list, frozen: list, weight_decay: float) -> str | None:
    lab = solution("13_sharding")
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in shapes]
    mine = [nn.Parameter(t.clone(), requires_grad=not f) for t, f in zip(start, frozen)]
    theirs = [nn.Parameter(t.clone(), requires_grad=not f) for t, f in zip(start, frozen)]
    sharded = lab.ShardedAdam(mine, lr=1e-2, weight_decay=weight_decay)
    reference = (torch.optim.AdamW(theirs, lr=1e-2, weight_decay=weight_decay) if weight_decay
                 else torch.optim.Adam(theirs, lr=1e-2))
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        local = [torch.randn(shape, generator=g) for shape in shapes]
        for p, q, grad in zip(mine, theirs, local):
            if p.requires_grad:
                p.grad = grad.clone()
                q.grad = grad.clone()
                dist.all_reduce(q.grad, op=dist.ReduceOp.AVG)  # what DDP gives the reference
        sharded.step()
        sharded.zero_grad()
        reference.step()
        reference.zero_grad()
        for i, (p, q) in enumerate(zip(mine, theirs)):
            if not close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6):
                return f"step {step}, parameter {i} {tuple(p.shape)}: {p.detach()} vs {q.detach()}"
    return None


@generated(examples=12)
@given(world_size=st.integers(1, 5),
       layout=st.lists(st.tuples(st.lists(st.integers(1, 7), min_size=1, max_size=2), st.booleans()),
                       min_size=1, max_size=4).filter(lambda ps: not all(f for _, f in ps)),
       weight_decay=st.sampled_from([0.0, 0.1]))
def test_lab13_sharded_adam_equals_adam_and_adamw(world_size, layout, weight_decay):
    shapes, frozen = [tuple(s) for s, _ in layout], [f for _, f in layout]
    results = run_ranks(sharded_vs_adamw, world_size, shapes, frozen, weight_decay, show_output=False, timeout=60)
    assert results == [None] * world_size, results


# --- Lab 06: the sampler against DistributedSampler (no processes needed) -------------------------


@generated(examples=200)
@given(n=st.integers(0, 40), world_size=st.integers(1, 5), epoch=st.integers(0, 3), shuffle=st.booleans(),
       seed=st.integers(0, 2**31), drop_last=st.booleans(), data=st.data())
def test_lab06_shard_indices_equal_distributed_sampler(n, world_size, epoch, shuffle, seed, drop_last, data):
    from torch.utils.data.distributed import DistributedSampler

    rank = data.draw(st.integers(0, world_size - 1))
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    mine = solution("06_sampler").shard_indices(n, world_size, rank, epoch, shuffle, seed, drop_last)
    assert mine == list(sampler)


# --- Lab 07: synchronized BatchNorm against BatchNorm on the gathered batch -----------------------


def sync_bn_vs_gathered(rank: int, world_size: int, sizes: list[int], channels: int, pixels: int) -> str | None:
    lab = solution("07_syncbn")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), channels, pixels, pixels, generator=g) * 3 + 1
    upstream = torch.randn(x.shape, generator=g)
    first = sum(sizes[:rank])
    mine_x = x[first:first + sizes[rank]].clone().requires_grad_()
    mine = lab.HandSyncBatchNorm2d(channels, momentum=0.3)
    mine_out = mine(mine_x)
    mine_out.mul(upstream[first:first + sizes[rank]]).sum().backward()
    whole_x = x.clone().requires_grad_()
    theirs = nn.BatchNorm2d(channels, momentum=0.3)
    out = theirs(whole_x)
    out.mul(upstream).sum().backward()
    weight_grad = mine.weight.grad.clone()
    dist.all_reduce(weight_grad)  # each rank holds its own share of the parameter gradients
    pairs = {"output": (mine_out, out[first:first + sizes[rank]]),
             "running_mean": (mine.running_mean, theirs.running_mean),
             "running_var": (mine.running_var, theirs.running_var),
             "input gradient": (mine_x.grad, whole_x.grad[first:first + sizes[rank]]),
             "weight gradient": (weight_grad, theirs.weight.grad)}
    for name, (a, b) in pairs.items():
        if not close(a.detach(), b.detach(), rtol=1e-4, atol=1e-5):
            return f"{name}: {a} vs {b}"
    return None


@generated(examples=10)
@given(world_size=st.integers(1, 5), data=st.data(), channels=st.integers(1, 4), pixels=st.integers(1, 3))
def test_lab07_sync_bn_equals_bn_on_the_whole_batch(world_size, data, channels, pixels):
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=world_size, max_size=world_size)
                      .filter(lambda s: sum(s) * pixels * pixels > 1))
    results = run_ranks(sync_bn_vs_gathered, world_size, sizes, channels, pixels, show_output=False, timeout=60)
    assert results == [None] * world_size, results


# --- Lab 09: the loss scaler against GradScaler (no processes needed) -----------------------------


@generated(examples=60)
@given(events=st.lists(st.sampled_from(["finite", "finite", "finite", "inf", "nan"]), min_size=1, max_size=12),
       growth_interval=st.integers(1, 4), growth=st.sampled_from([2.0, 4.0]), backoff=st.sampled_from([0.5, 0.125]),
       unscale_first=st.booleans())
def test_lab09_loss_scaler_equals_grad_scaler(events, growth_interval, growth, backoff, unscale_first):
    lab = solution("09_amp")
    settings_ = dict(init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff, growth_interval=growth_interval)
    runs = []
    for make in (lambda: lab.LossScaler(**settings_), lambda: torch.amp.GradScaler("cpu", **settings_)):
        scaler, w = make(), nn.Parameter(torch.ones(3))
        optimizer = torch.optim.SGD([w], lr=0.5)
        scales = []
        for i, event in enumerate(events):
            loss = (w * torch.tensor([1.0, -2.0, 0.5])).sum() * (i + 1)
            if event != "finite":
                loss = loss * float(event)  # inf or nan reaches every gradient
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scales.append(scaler.get_scale())
        runs.append((scales, w.detach().clone()))
    (mine, w_mine), (theirs, w_theirs) = runs
    assert mine == theirs
    assert torch.equal(w_mine, w_theirs)


# --- Lab 10: exact evaluation against one process -------------------------------------------------


def exact_vs_one_process(rank: int, world_size: int, n: int, batch: int) -> tuple[float, float, float, float]:
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    lab = solution("10_dist_eval")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Linear(5, 3))  # dropout: eval() must hold
    g = torch.Generator().manual_seed(n)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False))
    accuracy, loss = lab.exact_metrics(lab.local_sums(model, loader, n, torch.device("cpu")))
    with torch.no_grad():
        x, y = data.tensors
        logits = model(x)
        return accuracy, loss, (logits.argmax(1) == y).double().mean().item(), \
            nn.functional.cross_entropy(logits.double(), y).item()


@generated(examples=10)
@given(world_size=st.integers(1, 5), n=st.integers(1, 23), batch=st.integers(1, 8))
def test_lab10_exact_metrics_equal_one_process(world_size, n, batch):
    results = run_ranks(exact_vs_one_process, world_size, n, batch, show_output=False, timeout=60)
    for accuracy, loss, want_accuracy, want_loss in results:
        assert accuracy == pytest.approx(want_accuracy, abs=1e-12)
        assert loss == pytest.approx(want_loss, rel=1e-6)



# --- Lab 17: DiLoCo's outer step against torch.optim.SGD(nesterov=True) ----------------------------


def diloco_vs_sgd(rank: int, world_size: int, shapes: list, lr: float, momentum: float, syncs: int) -> str | None:
    lab = solution("17_diloco")
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    model = nn.Module()
    model.params = nn.ParameterList([nn.Parameter(t.clone()) for t in start])
    outer = lab.DiLoCo(model, lr=lr, momentum=momentum)
    reference = [nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(reference, lr=lr, momentum=momentum, nesterov=momentum > 0)
    for sync in range(syncs):
        moves = [[torch.randn(s, generator=torch.Generator().manual_seed(100 * sync + r)) for s in shapes]
                 for r in range(world_size)]  # every rank knows every rank's moves: the reference needs them
        with torch.no_grad():
            for p, move in zip(model.params, moves[rank]):
                p.sub_(move)
        outer.sync()
        for i, q in enumerate(reference):  # pseudo-gradient of rank r: anchor - (anchor - move) = move
            q.grad = torch.stack([moves[r][i] for r in range(world_size)]).mean(0)
        sgd.step()
        for i, (p, q) in enumerate(zip(model.params, reference)):
            if not close(p, q):
                return f"sync {sync}, parameter {i} {tuple(p.shape)}: {p.detach()} vs {q.detach()}"
    return None


@generated(examples=8)
@given(world_size=st.integers(1, 5), shapes=st.lists(st.lists(st.integers(1, 5), max_size=2), min_size=1, max_size=3),
       outer=st.sampled_from([(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)]), syncs=st.integers(1, 3))
def test_lab17_diloco_outer_step_equals_sgd_nesterov(world_size, shapes, outer, syncs):
    """Scalars (shape ()), vectors and matrices; local SGD is (1.0, 0.0): the average of the ranks."""
    results = run_ranks(diloco_vs_sgd, world_size, [tuple(s) for s in shapes], *outer, syncs, show_output=False,
                        timeout=60)
    assert results == [None] * world_size, results


# --- Lab 18: the gradient noise scale against a direct float64 computation --------------------------


def noise_terms_vs_direct(rank: int, world_size: int, micros: int, micro_batch: int, features: int, dtype: str,
                          subgroup: bool) -> str | None:
    """Least squares, whose per-sample gradient (w.x - y) x the reference writes down directly: every rank's
    micro-batch gradients through the solution's noise_terms, against the unbiased estimates computed in
    float64 from every sample of the group in one place."""
    lab = solution("18_batch_scaling")
    members = list(range(world_size - 1)) if subgroup else list(range(world_size))
    group = dist.new_group(members) if subgroup else None
    if rank not in members:
        return None
    g = torch.Generator().manual_seed(world_size * 100 + micros * 10 + micro_batch)
    w = torch.randn(features, generator=g, dtype=torch.float64)
    x = torch.randn(len(members), micros, micro_batch, features, generator=g, dtype=torch.float64)
    y = torch.randn(len(members), micros, micro_batch, generator=g, dtype=torch.float64)
    per_sample = ((x @ w) - y).unsqueeze(-1) * x              # (ranks, micros, samples, features)
    small = per_sample.mean(2)                                  # each micro-batch's gradient
    b_small, b_big = micro_batch, micro_batch * micros * len(members)
    small_sq = small.square().sum(-1).mean()
    big = per_sample.reshape(-1, features).mean(0)
    big_sq = big.square().sum()
    want = (big, (b_big * big_sq - b_small * small_sq) / (b_big - b_small),
            (small_sq - big_sq) / (1 / b_small - 1 / b_big))
    mine = [m.to(getattr(torch, dtype)) for m in small[members.index(rank)]]
    if micros * len(members) == 1:
        try:
            lab.noise_terms(mine, micro_batch, group)
        except ValueError:
            return None
        return "one micro-batch in the group was not refused"
    got = lab.noise_terms(mine, micro_batch, group)
    tol = 1e-10 if dtype == "float64" else 2e-4  # float32 inputs: the estimates cancel about a digit
    for name, a, b in zip(("mean", "g2", "trace"), got, want):
        if a.dtype != getattr(torch, dtype) or not torch.allclose(a.double(), b, rtol=tol, atol=tol * b.abs().max().item()):
            return f"{name}: {a} vs {b}"
    return None


@generated(examples=6)
@given(world_size=st.integers(1, 5), micros=st.integers(1, 3), micro_batch=st.integers(1, 9),
       features=st.integers(1, 12), dtype=st.sampled_from(["float32", "float64"]), subgroup=st.booleans())
def test_lab18_noise_terms_equal_a_direct_float64_computation(world_size, micros, micro_batch, features, dtype,
                                                               subgroup):
    """1-5 ranks (a subgroup of all but the last), 1-3 micro-batches each; one micro-batch alone must be refused."""
    subgroup = subgroup and world_size > 1
    results = run_ranks(noise_terms_vs_direct, world_size, micros, micro_batch, features, dtype, subgroup,
                        show_output=False, timeout=60)
    assert results == [None] * world_size, results
