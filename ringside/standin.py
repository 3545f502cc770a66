"""A stand-in GPU for checks that run on a CPU: its random generators, held as state.

On a CPU-only machine `torch.manual_seed(s)` also "seeds every GPU", but that call is queued and never
runs, so a check cannot see what code would do to a GPU's generator. Inside `StandInGPU()` the
handful of `torch.cuda` random functions are replaced together, and each stand-in device gets a
generator of its own (a CPU `torch.Generator`, so its state can be saved, compared and drawn from).
Every path to a GPU generator then reaches the same stand-in: `torch.manual_seed`, `torch.seed`,
`torch.cuda.manual_seed(_all)`, `torch.cuda.seed(_all)`, `get_rng_state(_all)`, `set_rng_state(_all)`,
`initial_seed`, `torch.random.fork_rng` (which saves and restores through `torch.cuda`) and
`torch.cuda.default_generators`. A check compares `states()` before and after a call: whatever the
code called, the verdict is the state it left. `Module.to(a CUDA device)` and `Module.cuda()` keep
the module on the CPU, so code that moves its model to `cuda:0` runs here unchanged.

    with StandInGPU(devices=2, current=local_rank, namespaces=[learner_globals]) as gpu:
        before = gpu.states()
        build_model(seed, torch.device("cuda", local_rank))
        moved = [d for d, s in gpu.states().items() if s != before[d]]

Tensors cannot be made on a stand-in device (`torch.zeros(3, device="cuda")` still raises): code
that needs them cannot be judged this way, and `StandInGPU.unjudgeable(error)` says so.
"""

from __future__ import annotations

import torch
import torch.cuda
import torch.cuda.random
from torch import nn

# The torch.cuda functions that reach a GPU's generator (torch.random calls them through torch.cuda)
RANDOM = ("manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
          "get_rng_state_all", "set_rng_state", "set_rng_state_all")
DEVICE = ("is_available", "device_count", "current_device", "set_device")


class StandInDeviceError(RuntimeError):
    """Code asked the stand-in for a GPU that the node does not have (as a real GPU would refuse)."""


class StandInGPU:
    """While active, `devices` stand-in GPUs whose generators hold their own state (see the module)."""

    def __init__(self, devices: int = 1, current: int = 0, namespaces: tuple[dict, ...] | list[dict] = ()):
        self.count = max(1, devices)
        self.current = current
        self.generators = [torch.Generator() for _ in range(self.count)]
        for generator in self.generators:  # a fresh GPU's default seed
            generator.manual_seed(67280421310721)
        self.namespaces = list(namespaces)
        self.saved: list[tuple[object, str, object]] = []

    # --- the stand-in's state ------------------------------------------------------------------------

    def index(self, device=None) -> int:
        """The device index of `device` ("cuda", "cuda:1", 1, torch.device): as torch.cuda reads it."""
        if device is None:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise StandInDeviceError(f"expected a cuda device, got {device}")
            index = self.current if device.index is None else device.index
        else:
            index = int(device)
        if not 0 <= index < self.count:
            raise StandInDeviceError(f"invalid device ordinal {index}: this node has {self.count} GPU(s)")
        return index

    def states(self) -> dict[str, bytes]:
        """Every stand-in generator's state, as bytes that == compares."""
        return {f"cuda:{i}": bytes(g.get_state().numpy().tobytes()) for i, g in enumerate(self.generators)}

    @staticmethod
    def seeded_state(seed: int) -> bytes:
        """The state of a stand-in generator right after manual_seed(seed)."""
        return bytes(torch.Generator().manual_seed(seed).get_state().numpy().tobytes())

    def draw(self, index: int, n: int = 3) -> torch.Tensor:
        """Draw from stand-in GPU `index`, as `torch.rand(n, device=...)` draws from a real one."""
        return torch.rand(n, generator=self.generators[index])

    # --- the replacements ----------------------------------------------------------------------------

    def _functions(self) -> dict[str, object]:
        gens = self.generators

        def manual_seed(seed):
            gens[self.index()].manual_seed(int(seed))

        def manual_seed_all(seed):
            for g in gens:
                g.manual_seed(int(seed))

        def seed():
            gens[self.index()].seed()

        def seed_all():
            value = gens[0].seed()
            for g in gens[1:]:
                g.manual_seed(value)

        def initial_seed():
            return gens[self.index()].initial_seed()

        def get_rng_state(device="cuda"):
            return gens[self.index(device)].get_state()

        def get_rng_state_all():
            return [g.get_state() for g in gens]

        def set_rng_state(new_state, device="cuda"):
            gens[self.index(device)].set_state(new_state.clone())

        def set_rng_state_all(new_states):
            for g, state in zip(gens, new_states):
                g.set_state(state.clone())

        def set_device(device):
            self.current = self.index(device)

        return {"manual_seed": manual_seed, "manual_seed_all": manual_seed_all, "seed": seed,
                "seed_all": seed_all, "initial_seed": initial_seed, "get_rng_state": get_rng_state,
                "get_rng_state_all": get_rng_state_all, "set_rng_state": set_rng_state,
                "set_rng_state_all": set_rng_state_all, "is_available": lambda: True,
                "device_count": lambda: self.count, "current_device": lambda: self.current,
                "set_device": set_device}

    def _replace(self, owner, name: str, value) -> None:
        self.saved.append((owner, name, getattr(owner, name) if not isinstance(owner, dict) else owner[name]))
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)

    def __enter__(self) -> "StandInGPU":
        functions = self._functions()
        originals = {}
        for name in RANDOM + DEVICE:
            originals[id(getattr(torch.cuda, name))] = functions[name]
            self._replace(torch.cuda, name, functions[name])
            if hasattr(torch.cuda.random, name):
                originals[id(getattr(torch.cuda.random, name))] = functions[name]
                self._replace(torch.cuda.random, name, functions[name])
        self._replace(torch.cuda, "default_generators", tuple(self.generators))
        # A process forked after CUDA started is "in a bad fork": torch.manual_seed then skips the GPUs.
        # A stand-in GPU never started anything, so nothing is bad about the fork.
        self._replace(torch.cuda, "_is_in_bad_fork", lambda: False)
        for namespace in self.namespaces:  # `from torch.cuda import manual_seed_all` in the code judged
            for key, value in list(namespace.items()):
                if callable(value) and id(value) in originals:
                    self._replace(namespace, key, originals[id(value)])
        real_to, real_cuda = nn.Module.to, nn.Module.cuda

        def to(module, *args, **kwargs):
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type == "cuda":
                self.index(device)  # a GPU the node lacks is refused, as it would be
                return module if dtype is None else real_to(module, dtype)
            return real_to(module, *args, **kwargs)

        def cuda(module, device=None):
            self.index(device)
            return module

        self._replace(nn.Module, "to", to)
        self._replace(nn.Module, "cuda", cuda)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self.saved):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self.saved.clear()

    @staticmethod
    def unjudgeable(error: BaseException) -> bool:
        """True when `error` came from making a real CUDA tensor or generator, which no stand-in can
        provide: the code may be right on a GPU, so nothing can be concluded here."""
        if isinstance(error, StandInDeviceError):
            return False
        text = str(error).lower()
        return any(word in text for word in ("cuda", "nvidia", "gpu", "device"))


__all__ = ["StandInGPU", "StandInDeviceError"]
