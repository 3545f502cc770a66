"""The check of lab 08 (seeding): it runs the code of labs/08_seeding.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import random
from itertools import combinations
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab
from ringside.compare import all_gather_tensor
from ringside.effects import beyond_stand_in, rank_gpu
from ringside.standin import StandInDeviceError, StandInGPU

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------

def first_draws(device: torch.device, seed: int | None = None) -> dict:
    """What each global generator draws next (`seed` None), or what a fresh one seeded with `seed` draws."""
    def torch_rand(on: torch.device) -> list:
        return torch.rand(4, device=on, generator=None if seed is None else
                          torch.Generator(device=on).manual_seed(seed)).tolist()

    draws = {"random": random.random() if seed is None else random.Random(seed).random(),
             "np.random": float(np.random.random() if seed is None else np.random.RandomState(seed).random_sample()),
             "torch": torch_rand(torch.device("cpu"))}
    if device.type != "cpu":
        draws[f"torch on {device.type}"] = torch_rand(device)
    return draws


def check_seed_everything(checks: Checks, rank: int, device: torch.device) -> None:
    """Each global generator must continue exactly as a fresh one seeded with SEED + rank."""
    want = lab.SEED + rank
    got = lab.seed_everything(lab.SEED, rank)
    draws = first_draws(device)
    expected, shared = first_draws(device, want), first_draws(device, lab.SEED)
    checks.expect(got == want, f"seed_everything returned {got}, expected seed + rank = {want}")
    for name in expected:
        if draws[name] == expected[name]:
            continue
        if draws[name] == shared[name]:
            checks.fail(f"{name} is seeded with the shared seed {lab.SEED}: use seed + rank, so that ranks draw "
                        f"differently")
        else:
            call = {"random": "random.seed(seed + rank)", "np.random": "np.random.seed(seed + rank)"}.get(
                name, "torch.manual_seed(seed + rank)")
            checks.fail(f"{name} does not draw what a generator seeded with seed + rank = {want} draws: it is not "
                        f"seeded (or seeded with something else) - call {call} in seed_everything")


def rng_states(device: torch.device) -> dict:
    """Every global generator this rank draws from, each as a value that == compares."""
    states = {"cpu": torch.get_rng_state().numpy().tobytes(), "random": random.getstate(),
              "np.random": numpy_state(np.random.get_state())}
    if device.type == "cuda":
        states[str(device)] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return states


def numpy_state(state: tuple) -> tuple:
    """np.random.get_state() with its key array as bytes, so that == compares the values."""
    return (state[0], state[1].tobytes(), *state[2:])


def restarted_states(seed: int) -> dict:
    """What the CPU-side generators hold right after being seeded with `seed`."""
    return {"cpu": torch.Generator().manual_seed(seed).get_state().numpy().tobytes(),
            "random": random.Random(seed).getstate(), "np.random": numpy_state(np.random.RandomState(seed).get_state())}


def cpu_state_after_net(cpu_state: bytes) -> bytes:
    """Where building a Net leaves the CPU stream that held `cpu_state`: Net() draws its weights from it."""
    # devices=[] is right here (unlike in build_model): nothing below seeds or draws from a GPU
    # generator - the CPU state is set by hand, and Net() is built on the CPU.
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(torch.frombuffer(bytearray(cpu_state), dtype=torch.uint8))
        lab.Net()
        return torch.get_rng_state().numpy().tobytes()


def draw_a_little(device: torch.device) -> None:
    """Move every stream on, as a job does before it builds its model: a stream that is restarted from
    seed + rank then no longer passes for one that was kept."""
    random.random(), np.random.random(), torch.rand(3)
    if device.type == "cuda":
        torch.rand(3, device=device)


def check_streams_kept(checks: Checks, rank: int, device: torch.device) -> bool:
    """build_model must leave this rank's streams where they were: Python's, NumPy's, the CPU's and its
    GPU's. False when build_model cannot run on this device at all (the later checks would repeat that)."""
    lab.seed_everything(lab.SEED, rank)
    draw_a_little(device)
    before = rng_states(device)
    try:
        lab.build_model(lab.SEED, device)
    except Exception as error:
        if device.type != "cpu" or not any(word in str(error).lower() for word in ("cuda", "nvidia")):
            raise
        checks.fail(f"build_model reached for a GPU on a CPU-only rank ({str(error).split('.')[0]}): "
                    f"fork_rng's devices list takes GPUs only - devices=[device] if device.type == 'cuda' "
                    f"else [], and the Net goes to `device` as given")
        return False
    after = rng_states(device)
    moved = [name for name in before if after[name] != before[name]]
    checks.expect(not moved, streams_moved_diagnosis(moved, before, after, lab.SEED + rank))
    return True


def gpu_state_finding(after: bytes, before: bytes, seed: int, rank_seed: int, gpu: str) -> str | None:
    """What a function left in this rank's GPU generator (`gpu`), compared with before it ran."""
    if after == before:
        return None
    if after == StandInGPU.seeded_state(seed):
        return (f"on a GPU, build_model would reset this rank's CUDA generator to the shared seed {seed} "
                f"(rehearsed here with a stand-in {gpu} whose generator has its own state): every rank's dropout "
                f"on the GPU would then draw the same masks. torch.manual_seed seeds every GPU too, and "
                f"fork_rng puts back only the generators of the devices it is given")
    if after == StandInGPU.seeded_state(rank_seed):
        return (f"on a GPU, build_model would restart this rank's CUDA generator from seed + rank = {rank_seed} "
                f"(rehearsed with a stand-in {gpu}): every number drawn on the GPU since seed_everything comes "
                f"again - leave the GPU generator as it was before the call")
    return (f"on a GPU, build_model would leave this rank's CUDA generator in another state than before the call "
            f"(rehearsed with a stand-in {gpu} whose generator has its own state): its dropout masks would no "
            f"longer follow seed + rank - leave the GPU generator as it was")


def check_gpu_stream_kept(checks: Checks, rank: int, device: torch.device) -> None:
    """On a CPU rank, what build_model would do on a GPU, judged by the state it leaves: a stand-in
    GPU with a generator of its own is seeded by seed_everything, drawn from, then build_model runs
    with the device cuda:LOCAL_RANK; its generator must be where it was. Whatever the code called
    (torch.manual_seed, fork_rng, get/set_rng_state, torch.cuda.*), only the state is compared."""
    if device.type != "cpu":
        return  # on a GPU check_streams_kept sees the real CUDA generator
    with rank_gpu(lab.seed_everything, lab.build_model) as (fake, _):
        gpu = str(fake.device)
        try:
            lab.seed_everything(lab.SEED, rank)
            fake.draw(fake.device.index)
            before = fake.states()[gpu]
            lab.build_model(lab.SEED, fake.device)
            after = fake.states()[gpu]
        except StandInDeviceError as error:
            checks.fail(f"on a GPU, build_model would ask for a GPU this node lacks ({error}; rehearsed with device "
                        f"{gpu}, LOCAL_RANK {fake.device.index}): a rank's GPU is its local rank's")
            return
        except Exception as error:
            if not StandInGPU.unjudgeable(error):
                raise
            NOTES.append(f"the GPU generator after build_model: not checkable here ({str(error).splitlines()[0][:60]})")
            return
    finding = gpu_state_finding(after, before, lab.SEED, lab.SEED + rank, gpu)
    checks.expect(finding is None, finding or "")


def check_gpu_seeded(checks: Checks, rank: int, device: torch.device) -> None:
    """seed_everything must seed this rank's GPU generator with seed + rank too (on a CPU rank, a
    stand-in GPU shows what it would hold): else its dropout on a GPU starts from the default seed,
    the same on every rank."""
    if device.type != "cpu":
        return  # check_seed_everything draws from the real GPU
    with rank_gpu(lab.seed_everything) as (fake, _):
        fake.draw(fake.device.index)
        lab.seed_everything(lab.SEED, rank)
        got = fake.states()[str(fake.device)]
    if got == StandInGPU.seeded_state(lab.SEED + rank):
        checks.expect(True, "")
    elif got == StandInGPU.seeded_state(lab.SEED):
        checks.fail(f"on a GPU, seed_everything would seed this rank's CUDA generator with the shared seed {lab.SEED} "
                    f"(rehearsed with a stand-in {fake.device}): use seed + rank, so that ranks draw differently")
    else:
        checks.fail(f"on a GPU, seed_everything would leave this rank's CUDA generator unseeded (rehearsed with a "
                    f"stand-in {fake.device}): its dropout masks would not follow seed + rank - torch.manual_seed "
                    f"seeds the CPU and every GPU; the CPU's own generator alone does not")


NOTES: list[str] = []  # what this run could not check, printed by rank 0 before the verdict


STREAM_NAMES = {"cpu": "torch", "random": "Python random", "np.random": "NumPy"}


def streams(names: list[str]) -> str:
    """["cpu", "np.random"] -> "torch and NumPy streams": the streams as a learner calls them."""
    said = [STREAM_NAMES.get(name, f"torch on {name}") for name in names]
    return (", ".join(said[:-1]) + " and " + said[-1] if len(said) > 1 else said[0]) + \
        (" streams" if len(said) > 1 else " stream")


def streams_moved_diagnosis(moved: list[str], before: dict, after: dict, rank_seed: int) -> str:
    """Why build_model moved the streams `moved`, told from where they ended up."""
    restart = restarted_states(rank_seed)
    cpu_side = [name for name in moved if name in restart]
    if "cpu" in moved and all(after[name] == restart[name] for name in cpu_side):
        return (f"build_model reseeded this rank's {streams(cpu_side)} with seed + rank: a restart, and "
                f"every number drawn since seed_everything comes again - build the model inside "
                f"torch.random.fork_rng, which saves the streams and puts them back as they were")
    others = [name for name in moved if name in ("random", "np.random")]
    if others:
        return (f"build_model changed this rank's {streams(others)}, which fork_rng does not save and restore "
                f"(it keeps torch's generators only): seed only torch inside it, torch.manual_seed(seed)")
    if moved == ["cpu"] and after["cpu"] == cpu_state_after_net(before["cpu"]):
        return ("build_model drew the Net's initial weights from this rank's own stream: create the Net inside "
                "the fork_rng block, after torch.manual_seed(seed), not after the block ends")
    return (f"build_model changed this rank's random stream on {', '.join(moved)}: its dropout masks would "
            f"then follow the shared seed - seed inside torch.random.fork_rng, and give it every device the "
            f"rank draws from (an empty devices list restores only the CPU's generator, while "
            f"torch.manual_seed also seeds every GPU)")


def check_loader_keeps_streams(checks: Checks, rank: int, world_size: int, device: torch.device) -> None:
    """Making the loader, and starting to read it, must leave the global streams as they were: its
    workers' seeds come from a generator of its own. A DataLoader draws its base seed when an epoch's
    iterator starts, from its `generator=`, or from the global torch stream when it has none; the
    augmentations then depend on whatever the job drew before, and reading the loader moves the
    stream that the dropout masks come from."""
    lab.seed_everything(lab.SEED, rank)
    draw_a_little(device)
    before = rng_states(device)
    try:  # workers=0: starting an epoch starts no process; the base seed is drawn all the same
        loader = lab.make_loader(lab.JitteredImages(), lab.SEED, rank, world_size, workers=0)
    except ValueError:  # an option that needs workers (persistent_workers=True, prefetch_factor=...)
        loader = lab.make_loader(lab.JitteredImages(), lab.SEED, rank, world_size)
    made = rng_states(device)
    epoch = iter(loader)
    del epoch
    after = rng_states(device)
    moved = [name for name in before if made[name] != before[name]]
    if moved:
        if "cpu" in moved and made["cpu"] == restarted_states(lab.SEED + rank)["cpu"]:
            checks.fail("make_loader reseeded this rank's global torch generator: torch.manual_seed returns that "
                        "global generator, not a new one - give the DataLoader a generator of its own")
        else:
            checks.fail(f"make_loader changed this rank's global {streams(moved)}: the DataLoader needs a generator "
                        f"of its own")
        return
    moved = [name for name in before if after[name] != made[name]]
    checks.expect(not moved, f"starting to read the loader moved this rank's global {streams(moved or ['cpu'])}: "
                             f"the DataLoader drew its workers' base seed from it, so the augmentations depend on what "
                             f"the job drew before, and every epoch shifts the dropout masks - the loader's workers "
                             f"must take their seeds from a generator of the loader's own (seeded with seed + rank)")


def check_order_follows_seed(checks: Checks, rank: int, world_size: int) -> None:
    """Another seed must shuffle the data otherwise: the sampler's shuffle is part of what the seed fixes."""
    orders = [list(lab.make_loader(lab.JitteredImages(), seed, rank, world_size).sampler)
              for seed in (lab.SEED, lab.SEED + 1)]
    checks.expect(orders[0] != orders[1], "the order of the samples ignores the seed (seed + 1 gives this rank "
                                          "the same shard in the same order): DistributedSampler shuffles with "
                                          "its own seed 0 unless told - give it shuffle=True and seed=seed")


def check_weights_equal(checks: Checks, run: dict, rank: int) -> None:
    copies = all_gather_tensor(run["initial"])
    differ = [r for r, w in enumerate(copies) if not torch.equal(w, copies[0])]
    checks.expect(not differ, f"the initial weights of rank(s) {differ} differ from rank 0's: build the model "
                              f"from the shared seed (torch.manual_seed(seed) inside fork_rng), not seed + rank "
                              f"(DDP would then overwrite them with rank 0's, hiding the mistake)")


def check_masks_differ(checks: Checks, run: dict) -> None:
    masks = all_gather_tensor(run["mask"])
    same = [(a, b) for a, b in combinations(range(len(masks)), 2) if torch.equal(masks[a], masks[b])]
    checks.expect(not same, f"ranks {same} drew the same dropout mask: every rank drops the same units - "
                            f"seed torch with seed + rank, and keep the shared-seed model building inside "
                            f"fork_rng so it does not reset the rank's stream")


def check_shards(checks: Checks, run: dict, size: int) -> None:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, run["indices"].tolist())
    covered = set().union(*map(set, every))
    if len(every) > 1 and all(len(set(indices)) == size for indices in every):
        checks.fail(f"every rank read all {size} samples: the DataLoader needs a DistributedSampler (num_replicas="
                    f"world_size, rank=rank), which hands each rank its own shard")
        return
    checks.expect(len(covered) == size,
                  f"the ranks together read {len(covered)} of the {size} samples (their shards overlap): "
                  f"DistributedSampler's seed must be the same on every rank (seed, not seed + rank), so that "
                  f"all ranks cut one shared permutation - only the loader's generator takes the rank")


def copied_draws(count: int) -> set[float]:
    """The first draws of a dataset whose rng nobody reseeded: what a worker that kept its copy draws."""
    dataset = lab.JitteredImages()
    return {float(dataset[i][2]) for i in range(min(count, len(dataset)))}


def check_draws_differ(checks: Checks, run: dict, rank: int) -> bool:
    """No two workers of any rank may draw alike. False when they do (the epoch check would only echo it)."""
    draws, workers = run["draws"], run["workers"]
    by_worker = {int(w): set(draws[workers == w].tolist()) for w in workers.unique()}
    if len(by_worker) == 1:  # every rank's main process drew from the same dataset.rng: nothing more to learn
        checks.fail("all batches came from one worker: make_loader must use num_workers=workers")
        dist.all_gather_object([None] * dist.get_world_size(), None)  # in step with a rank that gathers below
        return False
    shared = set.intersection(*by_worker.values())
    if shared and shared <= copied_draws(len(draws)):
        checks.fail(f"its DataLoader workers drew the same augmentations ({len(shared)} equal draws), those of the "
                    f"dataset's rng as it was built: every worker copied dataset.rng - reseed it in seed_worker "
                    f"(worker_init_fn) from the seed torch gave the worker")
    else:
        checks.expect(not shared, f"its DataLoader workers drew the same augmentations ({len(shared)} equal draws), "
                                  f"though torch gave each worker its own seed: the seeds seed_worker derives from it "
                                  f"coincide for two workers - they must differ whenever torch.initial_seed() does")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ({w: sorted(d) for w, d in by_worker.items()},
                                   sorted(set(run["worker_seeds"].tolist()))))
    mine, my_seeds = set(draws.tolist()), set(every[rank][1])
    clash = [r for r, (other, _) in enumerate(every) if r != rank and set().union(*map(set, other.values())) & mine]
    same_seeds = [r for r, (_, seeds) in enumerate(every) if r != rank and set(seeds) & my_seeds]
    by_id = [r for r in clash if all(set(every[r][0].get(w, ())) & d for w, d in by_worker.items())]
    if not clash or shared:  # a rank whose own workers draw alike: named above, and the ranks alike follow
        checks.expect(True, "")
    elif same_seeds:
        checks.fail(f"drew the same augmentations as rank(s) {clash}: their workers got the same seeds from "
                    f"torch - seed the loader's generator with seed + rank")
    elif by_id == clash:
        checks.fail(f"drew the same augmentations as rank(s) {clash}, worker for worker, although torch gave every "
                    f"worker of every rank its own seed: seed_worker must derive the new seeds from "
                    f"torch.initial_seed(), not from worker_id (the same on every rank) or a constant")
    else:
        checks.fail(f"drew the same augmentations as rank(s) {clash}, although torch gave every worker of every rank "
                    f"its own seed: the seeds seed_worker derives coincide across ranks - they must differ whenever "
                    f"torch.initial_seed() does")
    return not shared and not clash


def check_epochs_differ(checks: Checks, run: dict) -> None:
    """Every epoch must draw new augmentations: the loader gives its workers new seeds every epoch."""
    repeated = set(run["draws"].tolist()) & set(run["next_draws"].tolist())
    checks.expect(not repeated, f"epoch 1 drew the same augmentations as epoch 0 ({len(repeated)} equal draws): "
                                f"seed_worker's seeds stay the same from epoch to epoch - derive them from "
                                f"torch.initial_seed(), which the loader draws anew every epoch")


def check_rerun(checks: Checks, first: dict, second: dict, rank: int) -> None:
    differ = [name for name in first if not torch.equal(first[name], second[name])]
    checks.expect(not differ, f"a second run from the same seed gave different {differ}: "
                              f"something draws from an unseeded source (np.random.default_rng() without a "
                              f"seed, time, os.getpid) - derive every generator from the seed")


def check_ddp_in_sync(checks: Checks, run: dict) -> None:
    checks.expect(all(torch.equal(w, run["final"]) for w in all_gather_tensor(run["final"])),
                  "after training, the ranks' weights differ: DDP keeps them equal only when every rank "
                  "runs the same number of steps on the same model")


def main(me: Rank, checks: Checks) -> None:
    try:
        check_seed_everything(checks, me.rank, me.device)
    except Exception as error:  # its GPU draws come from a torch.Generator(device="cuda"): none on a stand-in
        if not beyond_stand_in("seed_everything", error):
            raise
    if not check_streams_kept(checks, me.rank, me.device):
        return  # build_model cannot run on this device: every later check would only repeat that
    check_gpu_seeded(checks, me.rank, me.device)
    check_gpu_stream_kept(checks, me.rank, me.device)
    check_loader_keeps_streams(checks, me.rank, me.world_size, me.device)
    check_order_follows_seed(checks, me.rank, me.world_size)
    first = lab.one_run(me.rank, me.world_size, me.device)
    check_weights_equal(checks, first, me.rank)
    check_masks_differ(checks, first)
    check_shards(checks, first, len(lab.JitteredImages()))
    draws_differ = check_draws_differ(checks, first, me.rank)
    check_ddp_in_sync(checks, first)
    if draws_differ:  # else the epochs repeat for the reason just given
        check_epochs_differ(checks, first)
    second = lab.one_run(me.rank, me.world_size, me.device)  # the same job again, from the same seed
    check_rerun(checks, first, second, me.rank)
    print0(f"{len(first['draws'])} augmented samples per rank, 2 workers each, epochs 0 and 1; "
           f"the job ran twice from seed {lab.SEED}; a stand-in GPU per local rank for the GPU generators")
    for note in dict.fromkeys(NOTES):
        print0(note)


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 08 (seeding)")
