"""Lab 16 - fully sharded data parallel by hand (ZeRO-3): a wrapper like DDP whose ranks each keep
only a shard of every block's parameters.

Chapter 13's ZeRO-1 sharded the optimizer's state; here the parameters themselves are sharded. Each
block of the model that holds a weight matrix (here: two Linears, as FSDP wraps a transformer block)
is a *unit*: its parameters are flattened, padded with zeros to a multiple of the world size and cut
into one shard per rank (an fp32 nn.Parameter: the master weight). One step:

    forward:   all-gather a unit just before it runs, free it as soon as it has run
    backward:  gather it again where autograd needs it (a saved-tensor hook), once per unit, free it
               when done, and reduce-scatter the gradient of the gathered unit: each rank gets its
               shard's average
    step:      an elementwise torch.optim optimizer (SGD, Adam, AdamW) on model.parameters(): this
               rank's shards (clipping by a global norm, Adafactor and the like need the whole tensor)

A parameter outside the units (a norm's gain) or held by two units (a tied weight) stays whole on every
rank, its gradient averaged by finish_gradient_sync(), each Parameter once. With
compute_dtype=torch.bfloat16 the units are gathered (forward and backward) and computed in bf16 while
the shards stay fp32, gradients are reduced in fp32, and full_parameters() still returns float32.

The check trains your wrapper beside one process on the global batch and compares the weights after
every step, counts what is gathered (and in which dtype) and when it is freed, counts the all-reduces of
the replicated gradients, and reads full_parameters() under bf16 compute.

Run it with 4 processes:
    make lab CH=16 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/16_fsdp.py)
"""
# LAB: fill in every TODO, then run it with torchrun (the command is in the docstring).
# (For maintainers: `make labs` writes this file from solutions/16_fsdp.py; edit that one.)

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks


SEED = 0
STEPS = 4
BATCH_PER_RANK = 8
LR, MOMENTUM = 0.1, 0.9


class Block(nn.Module):
    """Two Linears with a tanh between them: one unit, gathered and freed as a whole."""

    def __init__(self, n_in: int, n_mid: int, n_out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(n_in, n_mid), nn.Linear(n_mid, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Four blocks (the units), a LayerNorm (replicated), a weight tied across two blocks (replicated)
    and a frozen bias. Unit sizes 1261, 167, 167 and 168: the first three need padding at every world
    size from 2 to 5, the last one divides by 2, 3 and 4. In backward autograd asks back fc2's weight of
    every block (and fc1's of the last): views of the gathered unit at offsets other than 0."""

    def __init__(self):
        super().__init__()
        self.inp = Block(64, 16, 13)
        self.norm = nn.LayerNorm(13)
        self.hidden = Block(13, 11, 13)
        self.again = Block(13, 11, 13)
        self.again.fc1.weight = self.hidden.fc1.weight  # tied: one Parameter held by two blocks
        self.out = Block(13, 7, 10)
        self.out.fc2.bias.requires_grad_(False)         # frozen

    def forward(self, x):
        x = torch.tanh(self.norm(self.inp(x)))
        x = torch.tanh(self.hidden(x))
        x = torch.tanh(self.again(x))
        return self.out(x)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return Net()


def find_units(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """(block, names of the parameters to shard, relative to the block: "fc2.weight") for every child of
    the model that holds a weight matrix: its trainable parameters that no other layer holds.
    Everything else stays whole on every rank."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    units = []
    for block in model.children():
        if not any(p.dim() >= 2 for p in block.parameters()):
            continue  # a norm: nothing worth sharding
        names = [n for n, p in block.named_parameters(remove_duplicate=False)
                 if p.requires_grad and holders[id(p)] == 1]
        if names:
            units.append((block, names))
    return units


# --- Your part: the pieces of a fully sharded wrapper -------------------------------------------


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """`rank`'s shard of the vector `flat` padded with zeros to the next multiple of world_size: a new
    tensor (not a view) of ceil(n / world_size) elements; shard r is the r-th of the equal pieces."""
    # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
    # TODO: return a new tensor: rank's equal piece of flat padded with zeros to a multiple of world_size
    raise NotImplementedError("the TODO above")


def all_gather_flat(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's shard, cast to `dtype` before it is sent, in rank order: one new tensor of
    world_size x shard.numel() elements (the padded vector, on every rank)."""
    # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
    # TODO: return every rank's shard, in rank order, in one tensor of dtype; the collective sends dtype, not the shard's own dtype
    raise NotImplementedError("the TODO above")


def average_shard(full_grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the average over the ranks of `full_grad` (a padded vector of the same
    length on every rank, in any dtype), computed and returned in float32."""
    # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
    # TODO: return this rank's float32 shard of the average over ranks: one collective, done in float32
    raise NotImplementedError("the TODO above")


class GatherUnit(torch.autograd.Function):
    """unit's shard -> the whole unit (padded, compute dtype) in forward; in backward, the gradient of
    the whole unit -> the average of this rank's shard of it."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: "Unit") -> torch.Tensor:
        ctx.unit = unit
        return all_gather_flat(shard, unit.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
        # TODO: free the unit's copy gathered for backward, and return the gradient of the shard (the average over ranks), None for unit
        raise NotImplementedError("the TODO above")


class Unit:
    """One block's sharded parameters and the hooks that gather them when the block runs."""

    def __init__(self, module: nn.Module, names: list[str], dtype: torch.dtype):
        self.module, self.names, self.dtype = module, names, dtype
        # (the layer that holds it, its name there) for "fc2.weight": (module.fc2, "weight")
        self.slots = [(module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]
        params = [layer._parameters[leaf] for layer, leaf in self.slots]
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        # (stuck? `make hint CH=16` prints hint 1 of 1; run it again for the next)
        # TODO: self.shard: this rank's shard of flat, an fp32 nn.Parameter
        raise NotImplementedError("the TODO above")
        for layer, leaf in self.slots:  # the layers no longer hold them: they are gathered into plain attributes
            del layer._parameters[leaf]
            setattr(layer, leaf, None)
        self.gathered = None        # the whole unit while the block's forward runs
        self.backward_copy = None   # the whole unit gathered again for backward
        # saved_tensors_hooks(self.pack, self.unpack) while the block's forward runs: a `with` block cannot
        # span two hooks, so before_forward enters the context by hand and after_forward leaves it
        self.saving = None
        module.register_forward_pre_hook(lambda m, args: self.before_forward())
        module.register_forward_hook(lambda m, args, out: self.after_forward())

    def place(self, full: torch.Tensor | None) -> None:
        """Give the block's layers their parameters as views of the whole (padded) unit, or None."""
        pieces = full[:sum(self.numels)].split(self.numels) if full is not None else [None] * len(self.names)
        for (layer, leaf), piece, shape in zip(self.slots, pieces, self.shapes):
            setattr(layer, leaf, piece.view(shape) if piece is not None else None)

    def before_forward(self) -> None:
        # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
        # TODO: gather the unit through GatherUnit, place it in the block, remember it in self.gathered, and enter saved-tensor hooks (self.pack, self.unpack) by hand, kept in self.saving, for the block's forward (after_forward leaves them)
        raise NotImplementedError("the TODO above")

    def pack(self, tensor: torch.Tensor):
        """What autograd keeps of a tensor it saves during this block's forward (a weight is saved as a
        view of the gathered unit: weight.t(), at the weight's offset in the unit)."""
        # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
        # TODO: for a tensor in the gathered unit's memory, return only where it lies in it (offset, size, stride); any other tensor, itself
        raise NotImplementedError("the TODO above")

    def after_forward(self) -> None:
        # (stuck? `make hint CH=16` prints hint 1 of 1; run it again for the next)
        # TODO: leave the saved-tensor hooks and free the gathered unit: no attribute of the block's layers or of self refers to it
        raise NotImplementedError("the TODO above")

    def unpack(self, packed):
        """Autograd needs a saved tensor back, in backward: the unit is gathered again once per backward,
        however many of its tensors autograd asks back."""
        # (stuck? `make hint CH=16` prints hint 1 of 2; run it again for the next)
        # TODO: a place in the unit -> that tensor, from the unit gathered again as plain values (the gradient already flows back through the forward's GatherUnit: this copy needs no autograd node of its own), once per backward, kept in self.backward_copy; anything else as it is
        raise NotImplementedError("the TODO above")


class FullyShardedDP(nn.Module):
    """ZeRO-3: wrap a model; .parameters() yields this rank's shards (and the replicated parameters)."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.names = [(name, p) for name, p in model.named_parameters()]  # every parameter, before sharding
        self.units, self.where = [], {}  # where: id(parameter) -> (its unit, its index in the unit)
        for module, names in find_units(model):
            params = [module.get_parameter(n) for n in names]
            unit = Unit(module, names, compute_dtype or torch.float32)
            self.units.append(unit)
            self.where.update({id(p): (unit, i) for i, p in enumerate(params)})
        self.replicated = [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if p is not None]
        self.module = model
        self.shards = nn.ParameterList([unit.shard for unit in self.units])

    def forward(self, *args):
        if self.compute_dtype is None:
            return self.module(*args)
        args = [a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        casts = {id(p): p.to(self.compute_dtype) for _, _, p in self.replicated}  # one cast per Parameter
        for m, n, p in self.replicated:
            del m._parameters[n]
            setattr(m, n, casts[id(p)])
        try:
            return self.module(*args)
        finally:
            for m, n, p in self.replicated:
                delattr(m, n)
                m._parameters[n] = p

    def finish_gradient_sync(self) -> None:
        """Call after backward: the shards have their averaged gradients already; average the rest."""
        # (stuck? `make hint CH=16` prints hint 1 of 1; run it again for the next)
        # TODO: average over the ranks, in place, the gradient of every replicated parameter that has one, each Parameter once
        raise NotImplementedError("the TODO above")

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole, in float32, by its name in the model (every rank)."""
        # (stuck? `make hint CH=16` prints hint 1 of 1; run it again for the next)
        # TODO: return {name: whole float32 tensor} for every name in self.names; sharded ones gathered, the padding dropped
        raise NotImplementedError("the TODO above")


# --- The training that uses it ------------------------------------------------------------------


def batches(rank: int, world_size: int):
    """STEPS batches of this rank's own BATCH_PER_RANK samples (rank r takes the r-th slice of each
    global batch): 64 random pixels and a label each, the same on every rank and every run."""
    generator = torch.Generator().manual_seed(SEED)
    n = STEPS * BATCH_PER_RANK * world_size
    x, y = torch.rand(n, 64, generator=generator), torch.randint(0, 10, (n,), generator=generator)
    for step in range(STEPS):
        start = (step * world_size + rank) * BATCH_PER_RANK
        yield x[start:start + BATCH_PER_RANK], y[start:start + BATCH_PER_RANK]


if __name__ == "__main__":  # the check is in checks/lab16.py: you need not read it
    from checks import lab16
    lab16.run(SEED=SEED, STEPS=STEPS, LR=LR, MOMENTUM=MOMENTUM, make_model=make_model, find_units=find_units,
              shard_of=shard_of, all_gather_flat=all_gather_flat, average_shard=average_shard,
              FullyShardedDP=FullyShardedDP, batches=batches)
