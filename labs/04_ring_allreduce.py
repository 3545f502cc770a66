"""Lab 04 - a ring all-reduce written by hand, then a home-made DDP that averages gradients with it.

Fill in the TODOs in order: split a tensor into chunks, swap chunks with your neighbours, run the
two phases of the ring, then use your ring to average a model's gradients. The check compares
your ring with dist.all_reduce (odd sizes, several dtypes) and your training with DDP, step by step.

Run it with 4 processes:
    make lab CH=04 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/04_ring_allreduce.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/04_ring_allreduce.py; edit that one.)

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from ringside import Checks, Rank, print0, run_lab
from ringside.compare import equal_on_all_ranks, flat_grads, flat_params, max_diff
from ringside.data import regression

# --- Your part 1: the ring ------------------------------------------------------------------


def ring_chunks(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split the 1-D tensor `flat` into `world_size` consecutive views (not copies) whose sizes
    differ by at most one: the first numel % world_size chunks get one extra element.
    10 elements on 4 ranks: sizes 3, 3, 2, 2. 3 elements on 4 ranks: 1, 1, 1, 0."""
    # TODO: base, extra = divmod(flat.numel(), world_size); chunk i has base + 1 elements if i < extra, else base; return the slices flat[start:start + size]
    raise NotImplementedError("the TODO above")


def send_right_receive_left(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
    """Send `outgoing` to rank + 1 and, at the same time, receive `incoming` from rank - 1
    (both wrap around). Every rank calls this at once, so none may wait before it has posted both."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # TODO: post dist.isend(outgoing, dst=right) and dist.irecv(incoming, src=left) first, then .wait() on both
    raise NotImplementedError("the TODO above")


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a contiguous `tensor` over all ranks, in place, with a ring; return it.

    Only point-to-point messages: no dist.all_reduce (or any other collective) inside."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor.view(-1), world_size)
    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once
    # TODO: scatter-reduce - for step in range(world_size - 1): send chunk (rank - step) % world_size, receive chunk (rank - step - 1) % world_size into landing[:that chunk's numel()], and add it to that chunk
    raise NotImplementedError("the TODO above")
    # now rank r holds the full sum of chunk (r + 1) % world_size
    # TODO: all-gather - for step in range(world_size - 1): send chunk (rank + 1 - step) % world_size, receive chunk (rank - step) % world_size straight into its place (no adding)
    raise NotImplementedError("the TODO above")
    return tensor


# --- Your part 2: a home-made DDP -----------------------------------------------------------


def average_gradients(model: nn.Module) -> None:
    """After backward: replace every parameter's .grad by its mean over all ranks, with one
    ring_all_reduce on one flat buffer of all gradients (what DDP does with its buckets)."""
    world_size = dist.get_world_size()
    grads = [p.grad for p in model.parameters()]
    # TODO: flat = torch.cat of every grad reshaped to 1-D; ring_all_reduce(flat); turn the sum into a mean; copy each slice back into its grad (g.copy_(flat[offset:offset + g.numel()].view_as(g)))
    raise NotImplementedError("the TODO above")


# --- The training that uses it (given) --------------------------------------------------------

SEED = 0
BATCH_PER_RANK = 16
STEPS = 8
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def my_batch(data: TensorDataset, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch `step`: consecutive blocks of the data."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = data.tensors
    start = (step * world_size + rank) * BATCH_PER_RANK
    return x[start:start + BATCH_PER_RANK], y[start:start + BATCH_PER_RANK]


def train(model: nn.Module, data: TensorDataset, by_hand: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS of SGD; by_hand: average the gradients with average_gradients (else `model` is a DDP
    and backward averages them). Returns (gradients, weights) after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        x, y = my_batch(data, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if by_hand:
            average_gradients(model)
        optimizer.step()
        history.append((flat_grads(model), flat_params(model)))
    return history


# --- The check ------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)


def ring_cases(world_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every dtype on a size divisible by world_size first (so a chunk-index mistake is seen
    before a size one), then sizes that are not: a remainder, fewer elements than ranks, 2-D."""
    f16, bf16, f32, f64, i32, i64 = DTYPES
    even = [((world_size * 5,), dtype) for dtype in DTYPES] + [((world_size * 64, 3), f32)]
    odd = [((world_size * 5 + 1,), f32), ((world_size * 5 + 1,), i64), ((world_size * 5 + 1,), f16),
           ((world_size * 64 + world_size - 1,), f64), ((1,), f32), ((7, 13), bf16), ((7, 13), i32)]
    return even + odd


def example(shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Different values on every rank. Floats are random normals; the 16-bit floats and the
    integers get small integers, whose sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    if dtype in (torch.float32, torch.float64):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def tolerance(dtype: torch.dtype, inputs_abs_sum: torch.Tensor, world_size: int) -> torch.Tensor:
    """Per element. The ring and gloo add the same N numbers in different orders; each order is
    within (N-1)*eps*sum|x| of the exact sum, so the two are within twice that. Exact sums
    (integers, and the small integers we give the 16-bit floats) must be equal."""
    if dtype.is_floating_point and dtype in (torch.float32, torch.float64):
        return 2 * (world_size - 1) * torch.finfo(dtype).eps * inputs_abs_sum
    return torch.zeros_like(inputs_abs_sum)


class UsedCollective(RuntimeError):
    pass


def forbid_collectives():
    """While the ring runs, the collectives that would do the job for it raise UsedCollective."""
    names = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
             "all_gather_into_tensor", "broadcast")
    saved = {name: getattr(dist, name) for name in names}

    def refuse(name):
        def call(*args, **kwargs):
            raise UsedCollective(f"ring_all_reduce called dist.{name} - build it from isend/irecv only")
        return call

    for name in names:
        setattr(dist, name, refuse(name))
    return lambda: [setattr(dist, name, fn) for name, fn in saved.items()]


def run_ring(tensor: torch.Tensor) -> str | None:
    """Call the learner's ring; return a diagnosis if it could not finish."""
    restore = forbid_collectives()
    try:
        ring_all_reduce(tensor)
    except UsedCollective as error:
        return str(error)
    except RuntimeError as error:
        text = str(error)
        if "Timed out" in text or "timed out" in text or "Connection closed" in text:
            return ("the ring stopped: a send or recv timed out - likely a deadlock. If every rank first "
                    "waits in a blocking recv (or send), no rank ever gets to its send: post isend and "
                    "irecv together, then wait on both")
        raise
    finally:
        restore()
    return None


def diagnose_ring(result: torch.Tensor, expected: torch.Tensor, mine: torch.Tensor, tol: torch.Tensor,
                  world_size: int) -> str:
    """What is wrong with `result`, and the likely mistake."""
    rank, numel = dist.get_rank(), result.numel()
    wrong = ((result.double() - expected.double()).abs() > tol).view(-1)
    where = (f"{tuple(result.shape)} {str(result.dtype).replace('torch.', '')}: "
             f"{int(wrong.sum())} of {numel} elements differ from dist.all_reduce")
    if torch.equal(result, mine) and world_size > 1:
        return f"{where} - the tensor is unchanged: write the sums into `tensor` itself (in place)"
    covered = world_size * (numel // world_size)
    if numel % world_size and not wrong[:covered].any():
        return (f"{where}, all in the last {numel % world_size} - the remainder chunk dropped? With numel "
                f"% world_size != 0, the first numel % world_size chunks need one extra element")
    bounds = [c.numel() for c in torch.arange(numel).tensor_split(world_size)]
    good = [not w.any() for w in wrong.split(bounds)]
    if good.count(True) == 1 and good.index(True) == (rank + 1) % world_size:
        return (f"{where}: only chunk {(rank + 1) % world_size}, the one this rank reduced, is right - "
                f"is the all-gather phase missing?")
    right = ", ".join(str(c) for c, ok in enumerate(good) if ok) or "none"
    return (f"{where} (chunks right: {right}) - an off-by-one chunk index? "
            f"At scatter-reduce step s rank r sends chunk (r - s) % N and receives (r - s - 1) % N; at "
            f"all-gather step s it sends (r + 1 - s) % N and receives (r - s) % N")


def check_ring(checks: Checks) -> bool:
    """The ring against dist.all_reduce on the same inputs; stops at the first failure."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for shape, dtype in ring_cases(world_size):
        mine = example(shape, dtype, rank)
        expected = mine.clone()
        dist.all_reduce(expected)
        abs_sum = mine.double().abs()
        dist.all_reduce(abs_sum)
        result = mine.clone()
        stopped = run_ring(result)
        if stopped:
            checks.fail(f"{shape} {str(dtype).replace('torch.', '')}: {stopped}")
            return False
        tol = tolerance(dtype, abs_sum, world_size)
        ok = result.dtype == dtype and result.shape == mine.shape and bool(
            ((result.double() - expected.double()).abs() <= tol).all())
        if not checks.expect(ok, "" if ok else diagnose_ring(result, expected, mine, tol, world_size)):
            return False
    return True


def check_training(checks: Checks) -> None:
    """The home-made DDP against DDP, step by step: same gradients, same weights."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = regression(n=STEPS * world_size * BATCH_PER_RANK)
    ours = train(make_model(), data, by_hand=True)
    theirs = train(DDP(make_model()), data, by_hand=False)
    for step, ((my_grads, my_weights), (ddp_grads, ddp_weights)) in enumerate(zip(ours, theirs)):
        if not equal_on_all_ranks(my_weights):
            checks.fail(f"step {step}: the weights differ between ranks - are the gradients averaged "
                        f"over all ranks (ring_all_reduce on every gradient) before optimizer.step()?")
            return
        # Tolerance: DDP sums the gradients in gloo's order, we in the ring's; float32 rounding
        # differs by about 1e-7 per step, and STEPS steps stay far below 1e-5. Mistakes are > 1e-3.
        gap = max_diff(my_grads, ddp_grads)
        if gap > 1e-5:
            ratio = (my_grads.norm() / ddp_grads.norm()).item()
            hint = (f"they are {ratio:.2f}x DDP's - did you divide by world_size? DDP averages, "
                    f"ring_all_reduce only sums" if abs(ratio - world_size) < 0.05 * world_size
                    else "check how the flat buffer is copied back into each parameter's grad")
            checks.fail(f"step {step}: the averaged gradients differ from DDP's by {gap:.2e} "
                        f"(tolerance 1e-5): {hint}")
            return
        gap = max_diff(my_weights, ddp_weights)
        if not checks.expect(gap <= 1e-5, f"step {step}: the weights differ from DDP's by {gap:.2e} "
                                          f"(tolerance 1e-5) although the gradients agree"):
            return
    print0(f"home-made DDP matches DDP for {STEPS} steps (max weight gap {gap:.1e})")


def main(me: Rank, checks: Checks) -> None:
    if check_ring(checks):
        print0(f"ring_all_reduce equals dist.all_reduce on {len(ring_cases(dist.get_world_size()))} "
               f"shape/dtype cases")
        check_training(checks)


# A short timeout (the default is 30 s): a deadlocked ring fails after 10 s instead of hanging.
if __name__ == "__main__":
    run_lab(main, title="Lab 04 (ring_allreduce)", timeout=timedelta(seconds=10))
