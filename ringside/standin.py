"""A stand-in GPU for checks that run on a CPU: tensors that live on it, and its random generators.

On a CPU-only machine code written for a GPU runs on the CPU, so a tensor made where a GPU run would
not put it (`torch.zeros(n)` without `device=`, a model never moved) passes every test here and
crashes there. Inside `StandInGPU(devices=N, current=k)` this machine behaves as one with N GPUs:

- `torch.cuda.is_available()`, `device_count()`, `current_device()`, `set_device()` say so;
- `torch.zeros(3, device="cuda:1")`, `x.new_zeros(...)`, `torch.empty_like(x)`, `x.to("cuda")`,
  `x.cuda()`, `model.to(device)` make tensors whose `.device` is `cuda:1`: a `StandInTensor`, which
  holds its values (and their autograd history) in a CPU tensor of its own, `held`;
- every op keeps the device (autograd, `nn.functional`, optimizers included); `.cpu()` copies back;
- a stand-in tensor meeting a CPU tensor (other than a 0-d scalar) raises what CUDA raises:
  "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!";
- a collective or send/recv (through `ringside.calls.Recorder`, which runs it on the CPU data) handed a
  tensor that is not on this rank's GPU is noted in `refused`, as NCCL would refuse it (it still runs,
  so that no other rank is left waiting);
- each stand-in GPU has a generator of its own (a CPU `torch.Generator`, so its state can be saved,
  compared and drawn from): `torch.randn(3, device="cuda")` and in-place random ops on stand-in
  tensors draw from it, and every path to a GPU generator reaches it (`torch.manual_seed`,
  `torch.cuda.manual_seed(_all)`, `seed(_all)`, `get/set_rng_state(_all)`, `initial_seed`,
  `torch.random.fork_rng`, `torch.cuda.default_generators`).

    with StandInGPU(devices=2, current=local_rank, namespaces=[learner_globals]) as gpu:
        before = gpu.states()
        model = build_model(seed, torch.device("cuda", local_rank))   # really on cuda:local_rank now
        moved = [d for d, s in gpu.states().items() if s != before[d]]

`DeviceMismatch` is the error of a tensor in the wrong place; `origin(tensor)` says where the
learner's code made a CPU tensor (file:line and its text), so a diagnosis can name it, and
`effects.device_diagnosis(function, error)` turns the error into one line. DDP is stood in by
`StandInDDP` (DDP's own refusals of devices, the inputs moved to device_ids[0], no averaging but in
ringside.gpubox's rehearsal: its C++ reducer cannot take stand-in tensors); a custom `autograd.Function` records its graph on the CPU data
while its forward and backward see stand-in tensors. What is not stood in: CUDA streams and events,
`torch.Generator(device="cuda")`, pinned memory, C++ code handed a stand-in tensor directly. Such code
raises, and `StandInGPU.unjudgeable(error)` says that nothing can be concluded.
"""

from __future__ import annotations

import linecache
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.cuda
import torch.cuda.random
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

# The torch.cuda functions that reach a GPU's generator (torch.random calls them through torch.cuda)
RANDOM = ("manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
          "get_rng_state_all", "set_rng_state", "set_rng_state_all")
DEVICE = ("is_available", "device_count", "current_device", "set_device", "synchronize", "is_current_stream_capturing",
          "is_bf16_supported")

# Ops that draw random numbers: on a stand-in tensor they draw from its GPU's generator
SEEDED = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
          "rand_like", "randn_like", "randint_like", "normal_", "uniform_", "bernoulli_", "random_",
          "exponential_", "cauchy_", "log_normal_", "geometric_", "dropout", "dropout_", "alpha_dropout",
          "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu", "rrelu_"}
# Ops that CUDA lets mix a GPU tensor with CPU ones: a copy, indexing with CPU indices
MAY_MIX = {"copy_", "__getitem__", "__setitem__", "to", "_has_compatible_shallow_copy_type",
           "swap_tensors", "__set__", "_foreach_copy_"}  # _foreach_copy_: per-tensor copy_ across devices
IN_PLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
            "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
# Functions that make a CPU tensor from nothing: where the learner's code called one is its origin
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "eye", "rand",
             "randn", "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
             "randn_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "cpu", "empty_strided"}

_ACTIVE: list["StandInGPU"] = []  # the stand-ins entered, innermost last
_ORIGINS = WeakIdKeyDictionary()  # CPU tensor -> where the learner's code made it (while a stand-in is active)
_BOX: dict = {}  # the GPU-box rehearsal's state while it is on (ringside.gpubox): see for_gloo


class StandInDeviceError(RuntimeError):
    """Code asked the stand-in for a GPU that the node does not have (as a real GPU would refuse)."""


class DeviceMismatch(RuntimeError):
    """A tensor where a GPU run would not have it: tensors on two devices met in one op (CUDA's
    error), or a collective got one that is not on this rank's GPU (NCCL's). `tensor` is the
    misplaced one, `role` what it was there ("dist.irecv's tensor", "an argument of add")."""

    def __init__(self, message: str, tensor: torch.Tensor | None = None, role: str = ""):
        super().__init__(message)
        self.tensor, self.role = tensor, role


class StandInTensor(torch.Tensor):
    """A tensor on a stand-in GPU: torch sees its device (cuda:k); its values, shape, dtype and autograd
    history are those of the CPU tensor it holds (`held`). Every torch function called with it runs
    on the held tensors (see `_call`), so views stay views and gradients reach `held.grad`."""

    held: torch.Tensor

    @staticmethod
    def __new__(cls, held: torch.Tensor, device: torch.device):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, held.shape, strides=held.stride(), storage_offset=held.storage_offset(), dtype=held.dtype,
            device=device, requires_grad=False)  # autograd is the held tensor's
        tensor.held = held
        return tensor

    def __init__(self, held: torch.Tensor, device: torch.device):
        super().__init__()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _call(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} reached a stand-in GPU tensor below Python (C++ code that the stand-in "
                           f"cannot run): this cannot be judged on a CPU")

    def __repr__(self) -> str:
        text = repr(self.held)
        return text[:-1] + f", device='{self.device}')" if text.endswith(")") else text

    def numpy(self, *args, **kwargs):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy "
                        f"the tensor to host memory first.")

    def __deepcopy__(self, memo):
        copied = StandInTensor(self.held.detach().clone().requires_grad_(self.held.requires_grad), self.device)
        if getattr(self, "_is_param", False):
            copied._is_param = True
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):  # pickled (torch.save, *_object collectives) as its CPU values
        return (_rebuild, (self.held.detach(), self.device.index))


def _rebuild(held: torch.Tensor, index: int) -> torch.Tensor:
    """A pickled stand-in tensor, unpickled: on the stand-in again where one is active."""
    return StandInTensor(held, torch.device("cuda", index)) if _ACTIVE else held


torch.serialization.add_safe_globals([_rebuild])  # torch.load(weights_only=True) reads GPU tensors back too


def held(value):
    """The CPU data of a stand-in tensor (in lists and dicts too); other values unchanged."""
    return tree_map(lambda x: x.held if isinstance(x, StandInTensor) else x, value)


def on_stand_in(tensor) -> bool:
    return isinstance(tensor, StandInTensor)


def _active() -> "StandInGPU":
    if not _ACTIVE:
        raise StandInDeviceError("a CUDA device was asked for outside a stand-in GPU")
    return _ACTIVE[-1]


def _as_device(device) -> torch.device:
    if isinstance(device, int):  # torch reads a bare index as a GPU
        return torch.device("cuda", device)
    return torch.device(device)


def _place(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) where `device` says: itself for the CPU, else wrapped for that stand-in GPU."""
    if device.type != "cuda":
        return tensor
    gpu = _active()
    return StandInTensor(tensor, torch.device("cuda", gpu.index(device)))


def _name(func) -> str:
    return getattr(func, "__name__", "") or getattr(getattr(func, "__func__", None), "__name__", "")


def _learner_frame():
    """The innermost frame of a lab or solution file on the stack (None outside one)."""
    frame = sys._getframe(2)
    while frame is not None:
        if Path(frame.f_code.co_filename).parent.name in ("labs", "solutions"):
            return frame
        frame = frame.f_back
    return None


def origin(tensor) -> str | None:
    """Where the learner's code made this CPU tensor (or the tensor it is a view of), as
    "`landing = torch.empty(n)` (labs/04_ring_allreduce.py:67)"; None where unknown."""
    for candidate in (tensor, getattr(tensor, "_base", None)):
        if isinstance(candidate, torch.Tensor) and candidate in _ORIGINS:
            return _ORIGINS[candidate]
    return None


def _note_origin(result) -> None:
    frame = _learner_frame()
    if frame is None or not isinstance(result, torch.Tensor) or isinstance(result, StandInTensor):
        return
    path = Path(frame.f_code.co_filename)
    text = linecache.getline(str(path), frame.f_lineno).split("  #")[0].strip()
    _ORIGINS[result] = f"`{text}` ({path.parent.name}/{path.name}:{frame.f_lineno})"


def _moved(tensor: torch.Tensor, device, dtype=None, copy: bool = False, memory_format=None) -> torch.Tensor:
    """`tensor.to(device, dtype)`, from or to a stand-in GPU: a copy on the CPU data, then placed."""
    source = tensor.device
    target = source if device is None else _as_device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", _active().current)
    data = tensor.held if isinstance(tensor, StandInTensor) else tensor
    dtype = dtype or data.dtype
    if target == source and dtype == data.dtype and not copy:
        return tensor
    kwargs = {} if memory_format is None else {"memory_format": memory_format}
    return _place(data.to(dtype=dtype, copy=copy or target != source, **kwargs), target)


def _to(tensor, *args, **kwargs):
    copy = kwargs.pop("copy", False)
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if args and isinstance(args[0], torch.Tensor):  # x.to(other): other's device and dtype
        device, dtype = args[0].device, args[0].dtype
    return _moved(tensor, device, dtype, copy, memory_format)


def _cuda(tensor, device=None, non_blocking=False, memory_format=None):
    device = torch.device("cuda", _active().current) if device is None else _as_device(device)
    return _moved(tensor, device, memory_format=memory_format)


def _cpu(tensor, memory_format=None):
    result = _moved(tensor, "cpu", memory_format=memory_format)
    if result is not tensor:
        _note_origin(result)
    return result


def _register_hook(tensor, hook):
    device = tensor.device
    return tensor.held.register_hook(lambda grad: held(hook(StandInTensor(grad, device))))


def _register_post_accumulate_grad_hook(tensor, hook):
    return tensor.held.register_post_accumulate_grad_hook(lambda _: hook(tensor))


SPECIAL = {torch.Tensor.to: _to, torch.Tensor.cuda: _cuda, torch.Tensor.cpu: _cpu,
           torch.Tensor.register_hook: _register_hook,
           torch.Tensor.register_post_accumulate_grad_hook: _register_post_accumulate_grad_hook}
# What a stand-in tensor answers itself (its device); everything else is asked of the held tensor
WHERE = {torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__,
         torch.Tensor.get_device}


def mismatch_message(first: torch.device, second: torch.device) -> str:
    return (f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{first} and {second}!")


def _call(func, args, kwargs):
    """Run a torch function the way it would run on a machine with the stand-in GPUs: on the CPU data
    of stand-in tensors, refusing devices that CUDA would refuse to mix, results placed on the device
    of the inputs (or the one `device=` names)."""
    if func in WHERE:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    special = SPECIAL.get(func)
    if special is not None and (isinstance(args[0], StandInTensor) or func in (torch.Tensor.to, torch.Tensor.cuda)):
        return special(*args, **kwargs)  # (a CPU tensor's .to("cuda") and .cuda() too)
    target = kwargs.get("device")
    found: list[torch.Tensor] = []

    def unwrap(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
            return value.held if isinstance(value, StandInTensor) else value
        return value

    inner_args, inner_kwargs = tree_map(unwrap, (args, kwargs))
    stand_ins = [t for t in found if isinstance(t, StandInTensor)]
    name = _name(func)
    if target is None and not stand_ins:  # nothing of the stand-in's: as torch does
        result = func(*args, **kwargs)
        if name in FACTORIES and _ACTIVE:
            _note_origin(result)
        return result
    if target is not None:
        target = _as_device(target)
        if target.type == "cuda":
            target = torch.device("cuda", _active().index(target))
            inner_kwargs["device"] = "cpu"
    # a 0-d CPU tensor is a scalar to CUDA: it may meet any device, but not be written with a GPU's values
    written = found[0] if found and (name in IN_PLACE or name.endswith("_") and not name.endswith("__")) else None
    counted = [t for t in found if isinstance(t, StandInTensor) or t is written
               or not (t.device.type == "cpu" and t.dim() == 0)]
    home = target or (counted or found)[0].device
    if name == "_has_compatible_shallow_copy_type" and len(stand_ins) == 1:
        return False  # `param.data = moved` cannot change a device: Module.to swaps the tensors instead
    if name not in MAY_MIX:
        for tensor in counted:
            if tensor.device != counted[0].device:
                gpu, other = sorted((counted[0], tensor), key=lambda t: t.device.type != "cuda")
                raise DeviceMismatch(mismatch_message(gpu.device, other.device), other,
                                     f"{name or func} got a tensor on the {other.device} with one on {gpu.device}")
    if home.type == "cuda" and name in SEEDED and inner_kwargs.get("generator") is None:
        with _active().drawing(home.index):
            result = func(*inner_args, **inner_kwargs)
    else:
        result = func(*inner_args, **inner_kwargs)
    given = {id(t.held if isinstance(t, StandInTensor) else t): t for t in found}

    def wrap(value):
        if not isinstance(value, torch.Tensor) or isinstance(value, StandInTensor):
            return value
        if id(value) in given:  # an in-place op returns its input: the same object
            return given[id(value)]
        return _place(value, home)

    return tree_map(wrap, result)


class _Context:
    """The `ctx` a custom autograd.Function sees on a stand-in GPU: the real one, through which the
    tensors it saves are kept as their CPU data (what autograd holds) and come back on their device."""

    def __init__(self, real):
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)

    def save_for_backward(self, *tensors):
        self._real.stand_in_devices = [_device_of(t) for t in tensors]
        self._real.save_for_backward(*held(tensors))

    @property
    def saved_tensors(self):
        return tuple(_placed(t, d) for t, d in zip(self._real.saved_tensors, self._real.stand_in_devices))

    def mark_dirty(self, *tensors):
        self._real.mark_dirty(*held(tensors))

    def mark_non_differentiable(self, *tensors):
        self._real.mark_non_differentiable(*held(tensors))


def _device_of(value):
    return value.device if isinstance(value, StandInTensor) else None


def _placed(tensor, device):
    return StandInTensor(tensor, device) if device is not None and isinstance(tensor, torch.Tensor) else tensor


def _function_apply(real_apply):
    """autograd.Function.apply on stand-in tensors: autograd records the Function on their CPU data
    (a graph through a stand-in tensor itself cannot be recorded on a CPU), while its forward and
    backward see stand-in tensors, and its outputs are placed where its forward made them."""
    def apply(cls, *args):
        if not any(isinstance(t, StandInTensor) for t in tree_leaves(args)):
            return real_apply(cls, *args)
        made = []  # the device of each output, in order (None: a CPU tensor or no tensor)

        def record(output):
            made[:] = [_device_of(t) for t in tree_leaves(output)]
            return held(output)

        def placed(output):
            devices = iter(made)
            return tree_map(lambda t: _placed(t, next(devices, None)), output)

        class OnStandIn(cls):
            if cls.setup_context is torch.autograd.Function.setup_context:
                @staticmethod
                def forward(ctx, *_):
                    return record(cls.forward(_Context(ctx), *args))
            else:
                @staticmethod
                def forward(*_):
                    return record(cls.forward(*args))

                @staticmethod
                def setup_context(ctx, inputs, output):
                    return cls.setup_context(_Context(ctx), args, placed(output))

            @staticmethod
            def backward(ctx, *grads):
                return held(cls.backward(_Context(ctx), *[_placed(g, d) for g, d in zip(grads, made)]))

        return placed(real_apply(OnStandIn, *held(args)))
    return apply


class _Factories(TorchFunctionMode):
    """Every torch function called while a stand-in is active: `device="cuda:k"` makes a stand-in
    tensor, `x.to("cuda")` moves one there, and CPU tensors the learner's code makes are noted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _call(func, args, kwargs or {})


class StandInDDP(DistributedDataParallel):
    """DistributedDataParallel on a stand-in GPU, where DDP's C++ reducer cannot run: it refuses what
    DDP refuses about devices (a model on the CPU with device_ids, parameters on two kinds of device,
    more than one device id) with DDP's own words, and moves the forward's inputs to device_ids[0] as
    DDP does. It does not average gradients (the check's CPU run compares what DDP computes), except
    in the GPU-box rehearsal (ringside.gpubox), where no CPU run is left to do it."""

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, *args, **kwargs):
        nn.Module.__init__(self)
        parameters = [p for p in module.parameters()]
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        types = {p.device.type for p in parameters}
        if len(types) != 1:
            raise ValueError("DistributedDataParallel's input module must be on the same type of devices, but "
                             f"input module parameters locate in {types}.")
        devices = {p.device for p in parameters}
        if not device_ids or types == {"cpu"} or len(devices) > 1:
            if device_ids or output_device:
                raise ValueError("DistributedDataParallel device_ids and output_device arguments only work with "
                                 "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                                 f"{device_ids}, output_device {output_device}, and module parameters {devices}.")
            self.device_ids = None
        else:
            self.device_ids = [_active().index(d) for d in device_ids]
        self.module = module
        self.device = parameters[0].device if parameters else torch.device("cpu")
        # In the GPU-box rehearsal (ringside.gpubox) the whole run is on the stand-in: DDP's averaging
        # is then done here, as DDP does it (states from the group's first rank, each gradient's
        # all-reduce once accumulated, divided by the group's size; buffers broadcast every forward)
        # (a communication hook gets one bucket of every gradient, once the last one is ready)
        self.averages, self.syncing, self.hook, self.ready = bool(_BOX), True, None, []
        self.group, self.broadcasts = kwargs.get("process_group"), kwargs.get("broadcast_buffers", True)
        self.trained = [p for p in parameters if p.requires_grad]
        if self.averages:
            self.source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            self._broadcast(parameters + list(module.buffers()))
            for parameter in self.trained:
                parameter.register_post_accumulate_grad_hook(self._average)

    def register_comm_hook(self, state, hook) -> None:
        self.hook = (state, hook)

    def _broadcast(self, tensors) -> None:
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, self.source, group=self.group)

    def _average(self, parameter) -> None:
        """Run by autograd once `parameter`'s gradient is accumulated: outside the stand-in's mode (a hook
        runs with none of the caller's), so it is entered again for the communication hook's code."""
        if not self.syncing:
            return
        if not any(isinstance(m, _Factories) for m in torch.overrides._get_current_function_mode_stack()):
            with _Factories():
                return self._average(parameter)
        if self.hook is None:
            dist.all_reduce(parameter.grad, group=self.group)
            parameter.grad.div_(dist.get_world_size(self.group))
            return
        self.ready.append(parameter)
        if len(self.ready) == len(self.trained):
            self.ready = []
            grads = [p.grad for p in self.trained]
            bucket = _Bucket(torch.cat([g.reshape(-1) for g in grads]), grads, self.trained)
            averaged = self.hook[1](self.hook[0], bucket).wait()
            with torch.no_grad():
                for grad, part in zip(grads, averaged.split([g.numel() for g in grads])):
                    grad.copy_(part.view_as(grad))

    def forward(self, *inputs, **kwargs):
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (inputs, kwargs))
        if self.averages and self.broadcasts:
            self._broadcast(list(self.module.buffers()))
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


class _Bucket:
    """The one bucket StandInDDP hands a communication hook (what the hooks here read of dist.GradBucket)."""

    def __init__(self, flat: torch.Tensor, grads: list, parameters: list):
        self.flat, self.grads, self.params = flat, grads, parameters

    def buffer(self) -> torch.Tensor:
        return self.flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self.flat = tensor

    def gradients(self) -> list:
        return self.grads

    def parameters(self) -> list:
        return self.params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class _Stream:
    """The stream of a stand-in GPU: everything on it has already happened."""

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class StandInGPU:
    """While active, `devices` stand-in GPUs, `current` the one this process uses (see the module)."""

    def __init__(self, devices: int = 1, current: int = 0, namespaces: tuple[dict, ...] | list[dict] = ()):
        self.count = max(1, devices)
        self.current = current
        self.generators = [torch.Generator() for _ in range(self.count)]
        for generator in self.generators:  # a fresh GPU's default seed
            generator.manual_seed(67280421310721)
        self.namespaces = list(namespaces)
        self.saved: list[tuple[object, str, object]] = []
        self.mode = _Factories()
        self.refused: list[DeviceMismatch] = []  # what NCCL would have refused, in order (see for_gloo)

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
            raise StandInDeviceError(f"CUDA error: invalid device ordinal {index}: this node has {self.count} GPU(s)")
        return index

    @property
    def device(self) -> torch.device:
        """This process's stand-in GPU."""
        return torch.device("cuda", self.current)

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

    @contextmanager
    def drawing(self, index: int):
        """While inside, the CPU's default generator is stand-in GPU `index`'s (an op that draws on
        the CPU data of a stand-in tensor draws from that GPU's generator)."""
        cpu = torch.random.default_generator
        saved = cpu.get_state()
        cpu.set_state(self.generators[index].get_state())
        try:
            yield
        finally:
            self.generators[index].set_state(cpu.get_state())
            cpu.set_state(saved)

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
                "set_device": set_device, "synchronize": lambda device=None: None,
                "is_current_stream_capturing": lambda: False,  # optimizers ask (torch 2.11)
                "is_bf16_supported": lambda including_emulation=True: True}  # a GPU of today's (Ampere on)

    def _replace(self, owner, name: str, value) -> None:
        self.saved.append((owner, name, getattr(owner, name) if not isinstance(owner, dict) else owner[name]))
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)

    def _module_to(self, real_to):
        """Module.to: onto a stand-in GPU for real. Each parameter keeps its identity (an optimizer made
        before the move still holds it), as `param.data = ...` keeps it on a GPU machine."""
        def to(module, *args, **kwargs):
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type == "cuda":
                self.index(device)  # a GPU the node lacks is refused, as it would be
            swap = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                return real_to(module, *args, **kwargs)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(swap)
        return to

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
        originals[id(DistributedDataParallel)] = StandInDDP
        for owner in (torch.nn.parallel, torch.nn.parallel.distributed):
            self._replace(owner, "DistributedDataParallel", StandInDDP)
        for namespace in self.namespaces:  # `from torch.cuda import manual_seed_all` in the code judged
            for key, value in list(namespace.items()):
                if callable(value) and id(value) in originals:
                    self._replace(namespace, key, originals[id(value)])
        accelerator = getattr(torch, "accelerator", None)  # optimizers ask it whether a graph is captured
        for name, value in (("current_stream", lambda device=None: _Stream()), ("device_count", lambda: self.count),
                            ("current_device_index", lambda: self.current), ("is_available", lambda: True),
                            ("synchronize", lambda device=None: None)):
            if accelerator is not None and hasattr(accelerator, name):
                self._replace(accelerator, name, value)
        self._replace(torch.cuda, "current_stream", lambda device=None: _Stream())
        function = torch.autograd.Function  # apply: a descriptor of its own (C or Python), put back as it was
        descriptor = function.__dict__["apply"]
        self.saved.append((function, "apply", descriptor))
        function.apply = classmethod(_function_apply(lambda cls, *args: descriptor.__get__(None, cls)(*args)))
        real_to = nn.Module.to
        self._replace(nn.Module, "to", self._module_to(real_to))
        self._replace(nn.Module, "cuda", lambda module, device=None: module.to(
            torch.device("cuda", self.index(device))))
        self._replace(nn.Module, "cpu", lambda module: module.to("cpu"))
        _ACTIVE.append(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        _ACTIVE.remove(self)
        for owner, name, value in reversed(self.saved):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self.saved.clear()

    @staticmethod
    def unjudgeable(error: BaseException) -> bool:
        """True when `error` came from something no stand-in provides (a CUDA stream, a generator made
        on a GPU, C++ code below the stand-in): the code may be right on a GPU, so nothing can be
        concluded here. A misplaced tensor (DeviceMismatch) and a GPU the node lacks are judgeable."""
        if isinstance(error, (StandInDeviceError, DeviceMismatch)):
            return False
        text = str(error).lower()
        return any(word in text for word in ("cuda", "nvidia", "gpu", "device", "below python"))





def _called_by_learner() -> bool:
    """Whether the call being made comes from the learner's code rather than from a check's. A check's own
    messages are not judged in its GPU pass: they use a gloo group of their own (CPU tensors) or the
    group's device (ringside.lab.everyone); the GPU-box rehearsal (ringside.gpubox) judges those too."""
    frame = sys._getframe(2)
    while frame is not None:
        folder = Path(frame.f_code.co_filename).parent.name
        if folder in ("labs", "solutions", "checks"):
            return folder != "checks"
        frame = frame.f_back
    return True


def refusal(op: str, name: str, value: torch.Tensor, device: torch.device) -> DeviceMismatch:
    """What NCCL raises for `value`, handed to dist.`op` as `name` on a rank whose GPU is `device`."""
    why = ('NCCL refuses it ("No backend type associated with device type cpu": an nccl group has no CPU '
           'backend)' if value.device.type == "cpu" else "NCCL works on one GPU per rank")
    return DeviceMismatch(f"dist.{op} got `{name}` on {value.device}, not on this rank's GPU {device}: {why}",
                          value, f"dist.{op}'s `{name}`")


def _object_refusal(op: str, gpu: "StandInGPU", device: torch.device) -> DeviceMismatch | None:
    """On nccl an object collective pickles into a tensor on torch.cuda.current_device()
    (torch 2.14.1's torch/distributed/distributed_c10d.py:4193 asks _get_object_coll_device, which answers
    "cuda" for an nccl group (:1466), and _object_to_tensor's `.to(device)` (:4086) takes the current
    one): refused unless that is this rank's GPU."""
    if gpu.current == device.index:
        return None
    return DeviceMismatch(f"dist.{op} pickles into a tensor on torch.cuda.current_device(), cuda:{gpu.current}, not "
                          f"on this rank's GPU {device}: NCCL works on one GPU per rank (call "
                          f"torch.cuda.set_device(LOCAL_RANK) first)")


def for_gloo(op: str, arguments: dict) -> tuple[dict, DeviceMismatch | None]:
    """The arguments of a collective or send/recv (name -> value), as gloo takes them: each stand-in
    tensor's CPU data (gloo writes into it, so the stand-in tensor sees the result). With the refusal
    NCCL would make of a tensor not on this rank's GPU (None if there is none, or no stand-in, or when
    the innermost of the lab's and the check's code calling is a check's), also added to the stand-in's
    `refused`. It is not raised: the call runs on gloo, so that the ranks whose calls it matches are not
    left waiting (a check reads `refused` once the function returned: effects.device_problem).
    In the GPU-box rehearsal (ringside.gpubox) every call on an nccl group is judged, the check's too,
    and raised, except the learner's inside a check's own GPU pass (rank_gpu), which is noted as above;
    a group made with backend="gloo" takes CPU tensors, as it does on a GPU machine."""
    if not _ACTIVE:
        return arguments, None
    gpu, refusals = _ACTIVE[-1], []
    judged, device, raised = _called_by_learner(), gpu.device, False
    if _BOX:
        backend = _BOX["backend_of"](arguments.get("group"))
        device = torch.device("cuda", _BOX["rank_gpu"])
        raised = not (judged and len(_ACTIVE) > 1)  # only a check's pass of the learner's code notes
        judged = "nccl" in backend and not ("gloo" in backend and all(
            leaf.device.type == "cpu" for leaf in tree_leaves(arguments) if isinstance(leaf, torch.Tensor)))
        if not raised:
            device = gpu.device

    def unwrap(name):
        def one(value):
            if not isinstance(value, torch.Tensor):
                return value
            if judged and value.device != device and not refusals:
                refusals.append(refusal(op, name, value, device))
            return value.held if isinstance(value, StandInTensor) else value
        return one

    if "object" in op:  # pickled, stand-in tensors too (StandInTensor.__reduce_ex__); lists filled in place
        refused = _object_refusal(op, gpu, device) if _BOX and judged else None
        if refused is not None and raised:
            raise refused
        gpu.refused += [refused] if refused is not None else []
        return arguments, refused
    unwrapped = dict(arguments)
    for name, value in arguments.items():
        inside = [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        if inside:  # a new list of the CPU data where there are tensors: gloo writes into that data
            unwrapped[name] = tree_map(unwrap(name), value)
    if refusals and raised:
        raise refusals[0]
    gpu.refused += refusals
    return unwrapped, (refusals[0] if refusals else None)


__all__ = ["StandInGPU", "StandInDeviceError", "StandInTensor", "StandInDDP", "DeviceMismatch", "held", "on_stand_in",
           "origin", "for_gloo"]
