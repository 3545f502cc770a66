"""The check of lab 08 (seeding): it runs the code of labs/08_seeding.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from itertools import combinations
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from ringside import Checks, Rank, print0, run_lab
from ringside.compare import all_gather_tensor

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# --- The checks -----------------------------------------------------------------------------------

def check_seed_everything(checks: Checks, rank: int, device: torch.device) -> None:
    """Each global generator must continue exactly as a fresh one seeded with SEED + rank."""
    want = lab.SEED + rank
    got = lab.seed_everything(lab.SEED, rank)
    draws = {"random": random.random(), "np.random": float(np.random.random()),
             "torch": torch.rand(4).tolist()}
    if device.type != "cpu":
        draws[f"torch on {device.type}"] = torch.rand(4, device=device).tolist()
    expected = {"random": random.Random(want).random(), "np.random": float(np.random.RandomState(want).random_sample()),
                "torch": torch.rand(4, generator=torch.Generator().manual_seed(want)).tolist()}
    if device.type != "cpu":
        expected[f"torch on {device.type}"] = torch.rand(
            4, device=device, generator=torch.Generator(device=device).manual_seed(want)).tolist()
    shared = {"random": random.Random(lab.SEED).random(),
              "np.random": float(np.random.RandomState(lab.SEED).random_sample()),
              "torch": torch.rand(4, generator=torch.Generator().manual_seed(lab.SEED)).tolist()}
    if device.type != "cpu":
        shared[f"torch on {device.type}"] = torch.rand(
            4, device=device, generator=torch.Generator(device=device).manual_seed(lab.SEED)).tolist()
    checks.expect(got == want, f"seed_everything returned {got}, expected seed + rank = {want}")
    for name in expected:
        if draws[name] == expected[name]:
            continue
        if draws[name] == shared.get(name):
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


def build_model_as_on_a_gpu() -> dict | None:
    """build_model(SEED, cuda:0) rehearsed on this CPU: which generators it would save and restore.

    Nothing touches CUDA: Module.to(a CUDA device) keeps the module where it is, fork_rng records the
    devices it was given and saves the CPU's generator only, and CUDA's get/set_rng_state are recorded.
    None when the rehearsal cannot tell (the code did something it does not model)."""
    asked = {"fork_rng": [], "cuda_state_saved": False}
    real_fork_rng, real_to = torch.random.fork_rng, torch.nn.Module.to

    @contextmanager
    def fork_rng(devices=None, enabled=True, *args, **kwargs):
        asked["fork_rng"].append(None if devices is None else list(devices))
        with real_fork_rng(devices=[], enabled=enabled):
            yield

    def to(module, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            return module
        return real_to(module, *args, **kwargs)

    def saved(*args, **kwargs):
        asked["cuda_state_saved"] = True
        return torch.get_rng_state()

    names = {"fork_rng": fork_rng}
    module_globals = lab.build_model.__globals__
    replaced = {k: v for k, v in module_globals.items() if v is real_fork_rng}  # `from torch.random import fork_rng`
    try:
        torch.random.fork_rng, torch.nn.Module.to = fork_rng, to
        real_state = (torch.cuda.get_rng_state, torch.cuda.set_rng_state, torch.cuda.get_rng_state_all,
                      torch.cuda.set_rng_state_all)
        torch.cuda.get_rng_state = torch.cuda.get_rng_state_all = saved
        torch.cuda.set_rng_state = torch.cuda.set_rng_state_all = lambda *a, **k: None
        module_globals.update({k: names["fork_rng"] for k in replaced})
        lab.build_model(lab.SEED, torch.device("cuda", 0))
    except Exception:
        return None
    finally:
        torch.random.fork_rng, torch.nn.Module.to = real_fork_rng, real_to
        (torch.cuda.get_rng_state, torch.cuda.set_rng_state, torch.cuda.get_rng_state_all,
         torch.cuda.set_rng_state_all) = real_state
        module_globals.update(replaced)
    return asked


def check_gpu_stream_kept(checks: Checks, device: torch.device) -> None:
    """On a CPU rank, what build_model would do on a GPU: torch.manual_seed(seed) seeds every GPU too,
    so fork_rng must save and restore this rank's GPU generator, or every rank's dropout on the GPU
    starts from the shared seed (the chapter's headline bug, invisible on a CPU)."""
    if device.type != "cpu":
        return  # on a GPU check_streams_kept sees the real CUDA generator
    asked = build_model_as_on_a_gpu()
    if asked is None or not asked["fork_rng"] or asked["cuda_state_saved"]:
        return  # no fork_rng (the CPU checks name that), or the GPU state kept by hand
    kept_gpu = all(devices is None or any(torch.device(d if not isinstance(d, int) else f"cuda:{d}").type == "cuda"
                                          for d in devices) for devices in asked["fork_rng"])
    checks.expect(kept_gpu, f"on a GPU, build_model would reset this rank's CUDA generator to the shared seed: "
                            f"fork_rng(devices={asked['fork_rng'][0]}) saves and restores the CPU's generator only, "
                            f"and torch.manual_seed(seed) seeds every GPU too (rehearsed here with device cuda:0) - "
                            f"give fork_rng this rank's GPU: devices=[device] when device.type == 'cuda'")


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
    """Making the loader must not touch the global streams: its generator is a new one of its own."""
    lab.seed_everything(lab.SEED, rank)
    draw_a_little(device)
    before = rng_states(device)
    lab.make_loader(lab.JitteredImages(), lab.SEED, rank, world_size)
    after = rng_states(device)
    moved = [name for name in before if after[name] != before[name]]
    if not moved:
        checks.expect(True, "")
    elif "cpu" in moved and after["cpu"] == restarted_states(lab.SEED + rank)["cpu"]:
        checks.fail("make_loader reseeded this rank's global torch generator: torch.manual_seed returns that "
                    "global generator, not a new one - give the DataLoader torch.Generator().manual_seed(seed + rank)")
    else:
        checks.fail(f"make_loader changed this rank's global {streams(moved)}: the DataLoader needs a generator "
                    f"of its own, torch.Generator().manual_seed(seed + rank)")


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


def check_draws_differ(checks: Checks, run: dict, rank: int) -> bool:
    """No two workers of any rank may draw alike. False when they do (the epoch check would only echo it)."""
    draws, workers = run["draws"], run["workers"]
    by_worker = {int(w): set(draws[workers == w].tolist()) for w in workers.unique()}
    if len(by_worker) == 1:  # every rank's main process drew from the same dataset.rng: nothing more to learn
        checks.fail("all batches came from one worker: make_loader must use num_workers=workers")
        dist.all_gather_object([None] * dist.get_world_size(), None)  # in step with a rank that gathers below
        return False
    shared = set.intersection(*by_worker.values())
    checks.expect(not shared, f"its DataLoader workers drew the same augmentations ({len(shared)} equal "
                              f"draws): every worker copied dataset.rng - reseed it in seed_worker "
                              f"(worker_init_fn) from torch.initial_seed()")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sorted(draws.tolist()), sorted(set(run["worker_seeds"].tolist()))))
    mine, my_seeds = set(every[rank][0]), set(every[rank][1])
    clash = [r for r, (other, _) in enumerate(every) if r != rank and set(other) & mine]
    same_seeds = [r for r, (_, seeds) in enumerate(every) if r != rank and set(seeds) & my_seeds]
    if not clash:
        checks.expect(True, "")
    elif same_seeds:
        checks.fail(f"drew the same augmentations as rank(s) {clash}: their workers got the same seeds from "
                    f"torch - seed the loader's generator with seed + rank")
    else:
        checks.fail(f"drew the same augmentations as rank(s) {clash}, although torch gave every worker of every "
                    f"rank its own seed: seed_worker must derive the new seeds from torch.initial_seed(), not "
                    f"from worker_id (the same on every rank) or a constant")
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
    check_seed_everything(checks, me.rank, me.device)
    if not check_streams_kept(checks, me.rank, me.device):
        return  # build_model cannot run on this device: every later check would only repeat that
    check_gpu_stream_kept(checks, me.device)
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
           f"the job ran twice from seed {lab.SEED}")


def run(**learner) -> None:
    """Check the lab's code: the lab file calls this with its functions and classes."""
    vars(lab).update(learner)
    run_lab(main, title="Lab 08 (seeding)")
