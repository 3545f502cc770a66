"""The stand-in GPU (ringside.standin): every path to a GPU generator reaches the same stand-in, and
leaving it puts torch back as it was. In one process, no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringside.standin import StandInDeviceError, StandInGPU


def reseeds_all(seed: int) -> None:
    torch.manual_seed(seed)


def through_fork_rng(devices):
    def run(seed: int) -> None:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
    return run


def saved_by_hand(seed: int) -> None:
    state = torch.cuda.get_rng_state(torch.device("cuda", 0))
    torch.manual_seed(seed)
    torch.cuda.set_rng_state(state, torch.device("cuda", 0))


def saved_all_by_hand(seed: int) -> None:
    states = torch.cuda.get_rng_state_all()
    torch.cuda.manual_seed_all(seed)
    torch.cuda.set_rng_state_all(states)


def chapter_recipe(seed: int) -> None:  # chapter 08: only the CPU's generator is seeded
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        model = nn.Linear(3, 2)
    model.to(torch.device("cuda", 0))


@pytest.mark.parametrize("code, kept", [
    (reseeds_all, False), (through_fork_rng([]), False), (through_fork_rng([0]), True),
    (through_fork_rng([torch.device("cuda:0")]), True), (through_fork_rng(None), True),
    (saved_by_hand, True), (saved_all_by_hand, True), (chapter_recipe, True),
    (lambda seed: torch.cuda.manual_seed(seed), False), (lambda seed: torch.cuda.random.manual_seed_all(seed), False),
    (lambda seed: torch.cuda.default_generators[0].manual_seed(seed), False),
    (lambda seed: torch.cuda.seed(), False),
])
def test_the_state_left_is_the_verdict(code, kept):
    with StandInGPU(devices=1) as gpu:
        torch.manual_seed(7)
        gpu.draw(0)
        before = gpu.states()
        code(1234)
        assert (gpu.states() == before) is kept


def test_torch_manual_seed_seeds_every_stand_in():
    with StandInGPU(devices=2, current=1) as gpu:
        torch.manual_seed(5)
        assert set(gpu.states().values()) == {StandInGPU.seeded_state(5)}
        torch.cuda.manual_seed(6)  # the current device only
        assert gpu.states() == {"cuda:0": StandInGPU.seeded_state(5), "cuda:1": StandInGPU.seeded_state(6)}
        assert torch.cuda.initial_seed() == 6


def test_a_name_imported_from_torch_cuda_reaches_it_too():
    namespace = {"manual_seed_all": torch.cuda.manual_seed_all}
    with StandInGPU(namespaces=[namespace]) as gpu:
        namespace["manual_seed_all"](3)
        assert gpu.states()["cuda:0"] == StandInGPU.seeded_state(3)
    assert namespace["manual_seed_all"] is torch.cuda.manual_seed_all


def test_module_to_a_gpu_stays_on_the_cpu_and_a_missing_gpu_is_refused():
    with StandInGPU(devices=2):
        model = nn.Linear(2, 2).to("cuda:1")
        assert next(model.parameters()).device.type == "cpu"
        assert next(model.to(torch.float64).parameters()).dtype == torch.float64
        with pytest.raises(StandInDeviceError):
            nn.Linear(2, 2).to("cuda:2")


def test_leaving_puts_torch_back():
    real = (torch.cuda.manual_seed_all, torch.cuda.get_rng_state, nn.Module.to, torch.cuda.default_generators)
    with StandInGPU():
        assert torch.cuda.is_available()
    assert (torch.cuda.manual_seed_all, torch.cuda.get_rng_state, nn.Module.to, torch.cuda.default_generators) == real
