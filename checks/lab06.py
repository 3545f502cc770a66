"""The check of lab 06 (sampler): it runs the code of labs/06_sampler.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

from ringside import Checks, Rank, print0, run_lab

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------

GRID = dict(n=(1, 3, 8, 10, 13, 17), world_size=(1, 2, 3, 4, 5), shuffle=(False, True),
            drop_last=(False, True), seed=(0, 7), epoch=(0, 1, 2))


class Shard(NamedTuple):
    """One rank's index list in one setting of the grid."""
    n: int
    world_size: int
    rank: int
    epoch: int
    shuffle: bool
    seed: int
    drop_last: bool

    def __str__(self) -> str:  # the call that gives this list, with shard_indices' own argument names
        names = dict(self._asdict(), num_replicas=self.world_size)
        return "shard_indices(" + ", ".join(f"{name}={names[name]}" for name in (
            "n", "num_replicas", "rank", "epoch", "shuffle", "seed", "drop_last")) + ")"


# Every rank of every setting of the grid. shard_indices is a plain function, so each process checks
# all of them and every rank reaches the same verdict with the same words.
SETTINGS = list(itertools.product(*GRID.values()))
SHARDS = [Shard(n, world_size, rank, epoch, shuffle, seed, drop_last)
          for n, world_size, shuffle, drop_last, seed, epoch in SETTINGS for rank in range(world_size)]


def reference(n, world_size, rank, epoch, shuffle, seed, drop_last) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def variant(n, world_size, rank, epoch, shuffle, seed, drop_last, *, generator_seed=None, shuffled=None,
            shuffle_at="start", pad="start", cut="end", take="stride") -> list[int]:
    """DistributedSampler's list, or what one classic mistake makes of it (see MISTAKES)."""
    shuffled = shuffle if shuffled is None else shuffled
    draw = torch.Generator().manual_seed(seed + epoch if generator_seed is None else generator_seed)

    def shuffled_list(items):
        return [items[i] for i in torch.randperm(len(items), generator=draw).tolist()] if shuffled else items

    order = shuffled_list(list(range(n))) if shuffle_at == "start" else list(range(n))
    per_rank = n // world_size if drop_last else -(-n // world_size)
    total = per_rank * world_size
    if drop_last:
        order = order[:total] if cut == "end" else order[n - total:]
    elif n:
        extra = total - n
        repeated = (list(range(n)) if pad == "plain" else order) * (1 + extra // n)
        order = order + (repeated[len(repeated) - extra:] if pad == "end" else repeated[:extra])
    if shuffle_at == "padded":
        order = shuffled_list(order)
    share = order[rank::world_size] if take == "stride" else order[rank * per_rank:(rank + 1) * per_rank]
    return shuffled_list(share) if shuffle_at == "share" else share


# The classic mistakes: how each changes DistributedSampler's recipe (given one shard), and its name.
MISTAKES = [
    (lambda s: dict(shuffle_at="padded"),
     "the list was shuffled after it was padded (or cut): DistributedSampler shuffles the n indices first, "
     "then pads (or cuts) that permutation - shuffle range(n), then pad or cut, then take order[rank::world_size]"),
    (lambda s: dict(shuffle_at="share"),
     "each rank shuffled its own share: DistributedSampler shuffles all n indices once, the same way on every "
     "rank, before it pads and strides - shuffle range(n), then pad or cut, then take order[rank::world_size]"),
    (lambda s: dict(generator_seed=s.seed),
     "every epoch reads the order of epoch 0: seed the generator with seed + epoch"),
    (lambda s: dict(generator_seed=s.seed + s.epoch + s.rank),
     "each rank shuffled with its own seed, so the ranks' shares overlap: every rank must shuffle with the "
     "same generator seed (seed + epoch, not the rank)"),
    (lambda s: dict(generator_seed=s.epoch), "the seed was left out: seed the generator with seed + epoch"),
    (lambda s: dict(shuffled=False), "the indices are in their plain order although shuffle=True: draw a permutation"),
    (lambda s: dict(shuffled=True), "the indices are shuffled although shuffle=False: keep 0..n-1 in order"),
    (lambda s: dict(take="block"),
     "this rank took a contiguous block: take every world_size-th index starting at the rank (order[rank::world_size])"),
    (lambda s: dict(pad="end"),
     "the padding repeats indices from the end of the list: DistributedSampler repeats them from its start"),
    (lambda s: dict(pad="plain"),
     "the padding repeats 0, 1, 2, ... (the start of the unshuffled list): repeat the first indices of the "
     "shuffled order"),
    (lambda s: dict(cut="start"),
     "with drop_last the list was cut at its start: keep the first n // world_size * world_size indices"),
]


def fits(got: list[int], shard: Shard, changes: dict) -> bool:
    try:
        return got == variant(*shard, **changes)
    except Exception:  # a variant that cannot exist for this setting
        return False


def length_mistake(got: list, want: list, s: Shard) -> str:
    if s.drop_last:
        return (f"{len(got)} indices instead of {len(want)}: with drop_last=True every rank gets "
                f"n // world_size samples - cut the list to a multiple of world_size")
    if s.n < s.world_size:
        return (f"{len(got)} indices instead of {len(want)}: without drop_last every rank gets "
                f"ceil(n / world_size) samples - pad the list by repeating indices from its start; with "
                f"n={s.n} smaller than world_size the padding repeats the list more than once")
    return (f"{len(got)} indices instead of {len(want)}: without drop_last every rank gets "
            f"ceil(n / world_size) samples - pad the list by repeating indices from its start")


def likely_mistake(got: dict, want: dict, wrong: list[Shard]) -> str:
    """The one mistake that explains every differing list of the grid (a single list can match a wrong
    recipe by chance), else what all ranks of the first differing setting read together."""
    for changes, hint in MISTAKES:
        if all(fits(got[s], s, changes(s)) for s in wrong):
            return hint
    for (one, first_hint), (other, second_hint) in itertools.combinations(MISTAKES, 2):
        if all(fits(got[s], s, {**one(s), **other(s)}) for s in wrong):
            return f"two mistakes: {first_hint}; and {second_hint}"
    counts = [sum(fits(got[s], s, changes(s)) for s in wrong) for changes, _ in MISTAKES]
    best = max(range(len(MISTAKES)), key=counts.__getitem__)
    if counts[best] * 2 >= len(wrong):
        return f"{counts[best]} of the {len(wrong)} differing lists fit one mistake (and more is wrong): {MISTAKES[best][1]}"
    first = wrong[0]
    ranks = [first._replace(rank=r) for r in range(first.world_size)]
    yours = [i for row in zip(*(got[s] for s in ranks)) for i in row]  # the list the ranks strode through
    theirs = [i for row in zip(*(want[s] for s in ranks)) for i in row]
    if sorted(yours) == sorted(theirs):
        return ("the ranks together read the right indices, in another order: the permutation is not "
                "DistributedSampler's - torch.randperm(n, generator=g) with a torch.Generator g seeded with "
                "seed + epoch (random.shuffle or numpy draw other permutations), shuffled before padding")
    missing = sorted(set(theirs) - set(yours))
    if missing:
        return (f"the ranks together never read {missing[:6]} in this setting, and read others more than once: "
                f"they do not cut one shared order - every rank must build the same list (the same generator "
                f"seed, seed + epoch), then take order[rank::world_size]")
    return ("the ranks read other indices than DistributedSampler: shuffle range(n) with a torch.Generator "
            "seeded with seed + epoch, pad by repeating from the start of that order (or cut it, with "
            "drop_last), then take order[rank::world_size]")


def where_it_crashed(crashed: list[Shard]) -> str:
    """What all the crashing shards have in common (a corner of the grid), or nothing."""
    if len(crashed) == len(SHARDS):
        return ""
    corners = [("n smaller than world_size", lambda s: s.n < s.world_size),
               ("n not a multiple of world_size", lambda s: s.n % s.world_size and s.n > s.world_size),
               ("drop_last=True, where a rank's share is empty", lambda s: s.drop_last and s.n < s.world_size),
               ("drop_last=True", lambda s: s.drop_last),
               ("drop_last=False, where the padding repeats the list several times over",
                lambda s: not s.drop_last and s.n < s.world_size),
               ("drop_last=False", lambda s: not s.drop_last),
               ("shuffle=True", lambda s: s.shuffle), ("shuffle=False", lambda s: not s.shuffle)]
    common, said = [], ""
    for name, holds in corners:
        if all(holds(s) for s in crashed) and name.split(",")[0] not in said:
            common.append(name)
            said += name
    return f", all with {' and '.join(common)}" if common else ""


def run_shard(s: Shard) -> tuple[list[int] | str, bool]:
    """What ShardSampler gives for one shard (or the error it raised), and whether it changed torch's
    global random state (a sampler must not reseed or draw from it: that is every rank's own stream,
    for dropout and augmentation)."""
    sampler = lab.ShardSampler(range(s.n), s.world_size, s.rank, shuffle=s.shuffle, seed=s.seed, drop_last=s.drop_last)
    sampler.set_epoch(s.epoch)
    state = torch.get_rng_state()
    try:
        got = list(sampler)
    except NotImplementedError:
        raise
    except Exception as error:  # a crash on a corner of the grid is a finding, not the end
        got = f"{type(error).__name__}: {error}"
    touched = not torch.equal(state, torch.get_rng_state())
    torch.set_rng_state(state)
    return got, touched


def grid_verdict() -> str | None:
    """None when shard_indices gives DistributedSampler's list for every shard of the grid, else what
    differs first and the likely cause."""
    got, want, touched = {}, {}, []
    for s in SHARDS:
        got[s], changed = run_shard(s)
        want[s] = reference(*s)
        if changed:
            touched.append(s)
    crashed = [s for s in SHARDS if isinstance(got[s], str)]
    if crashed:
        return (f"{crashed[0]}: shard_indices raised {got[crashed[0]]} (on {len(crashed)} of the {len(SHARDS)} "
                f"index lists{where_it_crashed(crashed)})")
    if touched:
        s = next((s for s in touched if got[s] != want[s]), touched[0])
        if got[s] == want[s]:
            # Right wherever it touched the global generator: most likely torch.manual_seed in the sampler,
            # but a draw from the global generator can match by chance (1 in 6 for n=3): name both.
            return (f"{s}: the indices are right, but shard_indices changed torch's global random state - "
                    f"either torch.manual_seed in the sampler (it resets every rank's own stream, dropout and "
                    f"augmentation, each epoch) or the permutation came from torch's global generator and "
                    f"matched by chance: seed a torch.Generator of its own and pass it to "
                    f"torch.randperm(n, generator=...)")
        return (f"{s}: yours {got[s][:6]}, DistributedSampler {want[s][:6]} - the permutation came from "
                f"torch's global generator (each rank's own stream): pass your seeded generator to "
                f"torch.randperm(n, generator=generator)")
    wrong = [s for s in SHARDS if got[s] != want[s]]  # index lists: equal or not, no tolerance
    if not wrong:
        return None
    short = [s for s in wrong if len(got[s]) != len(want[s])]
    s = (short or wrong)[0]
    cause = length_mistake(got[s], want[s], s) if short else likely_mistake(got, want, wrong)
    return f"{s}: yours {got[s][:6]}, DistributedSampler {want[s][:6]} - {cause}"


def check_grid(checks: Checks) -> None:
    """shard_indices against DistributedSampler on every rank of every setting of the grid."""
    verdict = grid_verdict()
    checks.expect(verdict is None, f"{verdict}")
    print0(f"shard_indices agrees with DistributedSampler on all {len(SETTINGS)} settings, every rank of each "
           f"({len(SHARDS)} index lists)" if verdict is None else
           "shard_indices differs from DistributedSampler (see below)")


def check_training_order(checks: Checks, dataset: TensorDataset, seen: list[list[int]]) -> None:
    """Each epoch this rank must read its own share, in the order DistributedSampler gives
    after set_epoch(epoch): a new order every epoch, and the ranks together read everything."""
    rank, world_size, n = dist.get_rank(), dist.get_world_size(), len(dataset)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    for epoch, order in enumerate(seen):
        if len(order) >= n and world_size > 1:
            checks.fail(f"read {len(order)} samples in epoch {epoch}, the whole data set: give the "
                        f"DataLoader sampler=DistributedSampler(...) (not shuffle=True)")
            return
    if seen and seen[0] == reference(n, world_size, rank, 0, False, 0, False):
        checks.fail("read its share in the plain order 0, W, 2W, ...: the sampler does not shuffle - "
                    "DistributedSampler(..., shuffle=True); set_epoch only changes a shuffled order")
        return
    for epoch in range(len(seen)):
        covered = set().union(*(theirs[epoch] for theirs in everyone))
        if len(covered) < n:
            own_seed = all(theirs[epoch] == reference(n, world_size, r, epoch, True, r, False)
                           for r, theirs in enumerate(everyone))
            cause = ("each rank shuffled with its own seed (seed + rank)" if own_seed else
                     "the ranks shuffled differently")
            checks.fail(f"epoch {epoch}: the ranks together read {len(covered)} of {n} samples and some twice - "
                        f"{cause}: DistributedSampler's seed must be the same on every rank, so that all "
                        f"ranks cut one shared permutation")
            return
    if len(seen) > 2 and seen[1] == seen[0] and seen[2] != seen[1]:
        checks.expect(False, "epoch 1 read epoch 0's samples in epoch 0's order, epoch 2 a new order: each new order "
                             "arrives one epoch late",
                      steps=["the sampler learns the epoch from the loop: when does the loader read it?",
                             "call sampler.set_epoch(epoch) before the epoch's first batch, not after its last"])
        return
    if len(seen) > 1 and seen[1] == seen[0]:
        checks.expect(False, "every epoch read the same samples in the same order: from epoch 1 on, "
                             "the global batches replay epoch 0's, so SGD sees the same batches in the same order "
                             "every epoch",
                      steps=["where does the order come from, and what tells it that a new epoch began? "
                             "(section 2 of the notebook)",
                             "DistributedSampler shuffles with seed + epoch, and learns the epoch only from "
                             "sampler.set_epoch(epoch), called every epoch on the sampler the loader uses"])
        return
    for epoch, order in enumerate(seen):
        want = reference(n, world_size, rank, epoch, True, 0, False)
        if epoch and order == reference(n, world_size, rank, epoch - 1, True, 0, False):
            hint = (f"it is the order of epoch {epoch - 1}: set_epoch takes effect when the loader is "
                    f"iterated - call sampler.set_epoch(epoch) before the epoch's first batch")
        elif order == reference(n, world_size, rank, epoch + 1, True, 0, False):
            hint = f"it is the order of epoch {epoch + 1}: pass this epoch's number, set_epoch(epoch)"
        else:
            hint = "call sampler.set_epoch(epoch) once per epoch, before the loop over the loader"
        checks.expect(order == want, f"epoch {epoch}: the order read is not DistributedSampler's "
                                     f"after set_epoch({epoch}) - {hint}")


def main(me: Rank, checks: Checks) -> None:
    check_grid(checks)
    dataset = lab.indexed_digits(300)
    seen = lab.train(dataset, me.device)
    check_training_order(checks, dataset, seen)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 06 (sampler)")
