"""The stand-in GPU (ringside.standin): every path to a GPU generator reaches the same stand-in, and
leaving it puts torch back as it was. In one process, no ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringside import run_ranks
from ringside.standin import DeviceMismatch, StandInDeviceError, StandInGPU, StandInTensor, held


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


def test_module_to_a_gpu_moves_it_there_and_a_missing_gpu_is_refused():
    with StandInGPU(devices=2):
        model = nn.Linear(2, 2)
        weight = model.weight
        assert model.to("cuda:1") is model and model.weight is weight  # the same parameter, moved
        assert weight.device == torch.device("cuda", 1) and isinstance(weight, nn.Parameter) and weight.is_leaf
        assert next(model.to(torch.float64).parameters()).dtype == torch.float64
        assert model.cpu().weight.device.type == "cpu"
        with pytest.raises(StandInDeviceError):
            nn.Linear(2, 2).to("cuda:2")


def test_leaving_puts_torch_back():
    real = (torch.cuda.manual_seed_all, torch.cuda.get_rng_state, nn.Module.to, torch.cuda.default_generators)
    with StandInGPU():
        assert torch.cuda.is_available()
    assert (torch.cuda.manual_seed_all, torch.cuda.get_rng_state, nn.Module.to, torch.cuda.default_generators) == real


# --- tensors on the stand-in GPU ------------------------------------------------------------------


def test_tensors_are_made_and_moved_as_on_a_machine_with_gpus():
    with StandInGPU(devices=2, current=1):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2 and torch.cuda.current_device() == 1
        x = torch.zeros(3, device="cuda:0")
        assert x.device == torch.device("cuda", 0) and isinstance(x, StandInTensor)
        assert torch.ones(2, device=torch.device("cuda", 1)).device.index == 1
        assert torch.arange(3.0).to("cuda").device == torch.device("cuda", 1)  # the current device
        assert torch.ones(2).cuda().device == torch.device("cuda", 1)
        for made in (x.new_zeros(2), x.new_full((2,), 3.0), torch.empty_like(x), torch.zeros_like(x), x[1:], x * 2 + 1,
                     x.sum(), torch.cat([x, x]), x.to(torch.float64), x.view(3, 1), x.max(0).values):
            assert made.device == x.device, made
        back = x.cpu()
        assert type(back) is torch.Tensor and back.device.type == "cpu"
        back += 1  # a copy: the GPU tensor is unchanged
        assert x.sum().item() == 0 and x.tolist() == [0.0, 0.0, 0.0]
        assert torch.zeros_like(x, device="cpu").device.type == "cpu"
        torch.cuda.set_device(0)
        assert torch.ones(1, device="cuda").device == torch.device("cuda", 0)
        with pytest.raises(StandInDeviceError):
            torch.zeros(1, device="cuda:2")
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()
    assert not torch.cuda.is_available() or torch.cuda.device_count() > 0


def test_a_gpu_tensor_meeting_a_cpu_tensor_raises_as_cuda_does():
    with StandInGPU(devices=1):
        x = torch.ones(3, device="cuda")
        with pytest.raises(DeviceMismatch, match="found at least two devices, cuda:0 and cpu!"):
            x + torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(3) * x
        assert (x + torch.tensor(2.0)).device == x.device  # a 0-d CPU tensor is a scalar
        x.copy_(torch.arange(3.0))  # a copy may cross devices
        x[0] = torch.tensor(5.0)
        assert x.tolist() == [5.0, 1.0, 2.0]


def test_views_stay_views_on_the_gpu():
    """The labs write into chunks of a flat buffer: the write must reach the buffer."""
    with StandInGPU(devices=1):
        flat = torch.zeros(6, device="cuda")
        chunks = flat.tensor_split(3)
        chunks[1].add_(1)
        chunks[2].copy_(torch.tensor([7.0, 8.0]))
        flat[:1] += 4
        flat.narrow(0, 1, 1).fill_(9)
        assert flat.tolist() == [4.0, 9.0, 1.0, 1.0, 7.0, 8.0]
        assert chunks[0]._base is not None and held(chunks[0]).data_ptr() == held(flat).data_ptr()
        assert chunks[1].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_autograd_optimizers_and_hooks_keep_the_device():
    with StandInGPU(devices=2, current=1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # made before the move
        model.to("cuda:1")
        seen = []
        model[0].weight.register_hook(lambda grad: seen.append(grad.device))
        x, y = torch.randn(5, 4, device="cuda:1"), torch.tensor([0, 1, 0, 1, 1], device="cuda:1")
        loss = nn.functional.cross_entropy(model(x), y)
        assert loss.device == torch.device("cuda", 1) and loss.requires_grad
        loss.backward()
        assert seen == [torch.device("cuda", 1)] and model[0].weight.grad.device == torch.device("cuda", 1)
        before = model[0].weight.detach().clone()
        sgd.step()
        assert not torch.equal(model[0].weight.detach().cpu(), before.cpu())
        sgd.zero_grad()
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        model(x).sum().backward()
        adam.step()
        grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        assert {g.device for g in grads} == {torch.device("cuda", 1)}
        with pytest.raises(DeviceMismatch):
            model(torch.randn(5, 4))  # the batch never moved: the first forward fails, as on a GPU


def test_random_ops_on_a_gpu_draw_from_its_generator():
    with StandInGPU(devices=2) as gpu:
        torch.manual_seed(3)
        cpu_before = torch.random.get_rng_state()
        drawn = torch.randn(4, device="cuda:1")
        assert torch.equal(held(drawn), torch.randn(4, generator=torch.Generator().manual_seed(3)))
        nn.init.normal_(torch.empty(3, device="cuda:1"))
        assert torch.equal(torch.random.get_rng_state(), cpu_before)  # the CPU's generator untouched
        assert gpu.states()["cuda:0"] == StandInGPU.seeded_state(3) != gpu.states()["cuda:1"]


def _collective_on_the_wrong_device(rank, world_size):
    from ringside.calls import Recorder

    with StandInGPU(devices=world_size, current=rank) as gpu, Recorder() as recorder:
        right = torch.full((2,), float(rank), device=gpu.device)
        dist.all_reduce(right)
        wrong = torch.ones(2)  # on the CPU: NCCL refuses it
        dist.all_reduce(wrong)
        refused = [str(error) for error in gpu.refused]
        # a future's value is the tensor handed in, on the GPU (review 5, lab 12: Future.then)
        halved = dist.all_reduce(right, async_op=True).get_future().then(lambda f: f.value()[0] / 2).wait()
        return right.tolist(), refused, wrong.tolist(), [c.device.type for c in recorder.calls[:2]], halved.device


def test_collectives_run_on_the_gpu_data_and_refuse_a_cpu_tensor():
    results = run_ranks(_collective_on_the_wrong_device, 2, timeout=60)
    for rank, (right, refused, wrong, devices, halved) in enumerate(results):
        assert str(halved) == f"cuda:{rank}"
        assert right == [2.0, 2.0]  # (after the third all_reduce)
        assert len(refused) == 1 and "dist.all_reduce got `tensor` on cpu, not on this rank's GPU" in refused[0]
        assert wrong == [2.0, 2.0]  # it ran (no rank is left waiting), and is noted as refused
        assert devices == ["cuda", "cpu"]


def test_a_cpu_scalar_may_meet_a_gpu_tensor_but_not_be_written_with_it():
    with StandInGPU(devices=1):
        total = torch.zeros(3, dtype=torch.float64)  # made without device=: on the CPU
        with pytest.raises(DeviceMismatch):
            total[0] += torch.ones(4, device="cuda").sum()  # a 0-d CPU view written with a GPU value


def test_ddp_stand_in_refuses_a_model_left_on_the_cpu_and_moves_the_inputs():
    from torch.nn.parallel import DistributedDataParallel as DDP

    with StandInGPU(devices=2, current=1):
        from torch.nn.parallel import DistributedDataParallel as StoodIn
        assert StoodIn is not DDP and issubclass(StoodIn, DDP)
        with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
            StoodIn(nn.Linear(2, 2), device_ids=[1])
        model = StoodIn(nn.Linear(2, 2).to("cuda:1"), device_ids=[1])
        assert model(torch.ones(3, 2)).device == torch.device("cuda", 1)  # DDP moves the batch
        with pytest.raises(DeviceMismatch):
            StoodIn(nn.Linear(2, 2).to("cuda:1"))(torch.ones(3, 2))  # without device_ids it does not


def test_a_diagnosis_names_the_function_the_tensor_and_where_it_was_made(tmp_path):
    """What a check prints for a misplaced tensor: the line of the learner's file that made it."""
    import importlib.util

    from ringside.effects import device_problem

    (tmp_path / "solutions").mkdir()
    lab = tmp_path / "solutions" / "99_lab.py"
    lab.write_text("import torch\n\n\ndef scaled(x):\n    scale = torch.ones(x.shape)\n    return x * scale\n")
    spec = importlib.util.spec_from_file_location("lab99", lab)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with StandInGPU(devices=1) as gpu:
        assert device_problem("scaled", module.scaled, torch.ones(2, device=gpu.device))[1] \
            == ("scaled, run as on a GPU machine: Expected all tensors to be on the same device, but found at least "
                "two devices, cuda:0 and cpu! - that tensor is made by `scale = torch.ones(x.shape)` "
                "(solutions/99_lab.py:5) on the cpu: make it where the tensors it works with are (device=x.device, "
                "torch.empty_like(x), or the `device` argument), or move it there with .to(x.device)")
        assert device_problem("scaled", module.scaled, torch.ones(2))[1] is None


def _batches_objects_and_nesting(rank, world_size):
    from ringside.calls import Recorder

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    with StandInGPU(devices=world_size, current=rank) as gpu, Recorder():
        out = torch.full((2,), float(rank), device=gpu.device)
        landing = torch.zeros(2)  # on the CPU: NCCL would refuse the receive
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, landing, left), dist.P2POp(dist.isend, out, right)]):
            work.wait()  # every op ran: no rank is left waiting
        names = [None] * world_size
        dist.all_gather_object(names, out)  # pickled as the stand-in tensor it is
        with Recorder() as inner:  # a check's recorder inside the stand-in's: unwrapped once
            dist.all_reduce(out)
        return (landing.tolist(), [str(e).split(":")[0] for e in gpu.refused], [n.device.type for n in names],
                out.tolist(), len(inner.calls))


def test_a_batch_runs_whole_and_its_misplaced_receive_is_noted():
    for rank, (landing, refused, names, summed, inner) in enumerate(run_ranks(_batches_objects_and_nesting, 2,
                                                                               timeout=60)):
        assert landing == [float(1 - rank)] * 2
        assert refused == ["dist.irecv got `tensor` on cpu, not on this rank's GPU cuda"]
        assert names == ["cuda", "cuda"] and summed == [1.0, 1.0] and inner == 1


class _Scale(torch.autograd.Function):  # a custom Function, as labs 07 and 16 write them
    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x, torch.tensor(2.0))
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, grad):
        x, two = ctx.saved_tensors  # each back where it was: x on the GPU, `two` on the CPU
        return grad * ctx.k * two / 2 + 0 * x, None


class _Square(torch.autograd.Function):  # the setup_context form
    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        assert x.device.type == "cuda"
        return 2 * x * grad


def test_a_custom_autograd_function_runs_on_the_gpu_with_its_gradient():
    with StandInGPU(devices=1):
        w = torch.ones(3, device="cuda", requires_grad=True)
        y = _Scale.apply(w, 3.0)
        assert y.device == w.device and y.requires_grad
        _Square.apply(y).sum().backward()
        assert w.grad.device == w.device and w.grad.tolist() == [18.0] * 3
    assert _Scale.apply(torch.ones(2), 2.0).tolist() == [2.0, 2.0]  # and as before outside it
