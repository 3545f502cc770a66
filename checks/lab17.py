"""The check of lab 17 (diloco): it runs the code of labs/17_diloco.py and says what is wrong.

You need not read it to do the lab. The lab file hands over its functions: `lab.X` below is the
lab's X (this module never imports the lab).

The verdict comes from what the code does, never from how it is written:
- outputs: average_pseudo_gradient on parameters of odd shapes (a matrix, a vector, a scalar) in float32
  and float64; three outer steps of DiLoCo at three (lr, momentum) pairs, local SGD's (1, 0) among them,
  against one process that applies torch.optim.SGD(nesterov=True) to the averaged pseudo-gradient;
  training with the lab's loop against one process that simulates every rank (AdamW inside);
- state: the inputs left as they were; a state_dict saved after two rounds, loaded into new objects, must
  go on bit for bit as the run that was never stopped;
- communication (ringside.calls): the bytes all-reduced per sync and per inner step, and every request
  completed before the function returned.
The diagnosis runs only after a FAIL: it replays the known mistakes (the sign of the pseudo-gradient, a
sum for an average, momentum without Nesterov, the anchor not moved, the parameters not reset) on the same
numbers and names one only when it predicts what was seen on every round.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from ringside import Checks, Rank, print0, run_lab
from ringside.calls import Recorder, lab_namespaces
from ringside.effects import Contract, Inputs, never_waited, on_rank_gpu, unwaited_diagnosis, watch
from ringside.lab import ranks_count

lab = SimpleNamespace()  # the lab's functions and classes, handed over by run()


# What each function promises besides its values (ringside.effects checks it on every watched call).
AVERAGE = Contract("average_pseudo_gradient", like="params")
SYNC = Contract("sync()")


def traffic_mistake(name: str, calls, params) -> str | None:
    """One all-reduce (or one per tensor) of the parameters' bytes, in their dtype, every request waited for."""
    want = sum(p.numel() * p.element_size() for p in params)
    other = sorted({c.op for c in calls if c.family != "all_reduce"})
    sent = sum(c.bytes for c in calls if c.family == "all_reduce")
    dtypes = sorted({str(c.dtype) for c in calls if c.family == "all_reduce"})
    if other:
        return f"{name} called {other}: the average of the pseudo-gradient is one all-reduce"
    if sent == 0:
        return f"{name} all-reduced nothing: the ranks never learn each other's pseudo-gradients"
    if sent != want:
        times = f"{sent / want:g}x" if sent % want == 0 or want % sent == 0 else f"{sent} bytes for {want}"
        return (f"{name} all-reduced {sent} bytes for parameters of {want} bytes ({times}, sent as {dtypes}): "
                + ("all-reduced twice? - send the pseudo-gradient once" if sent > want else
                   f"the parameters are {params[0].dtype}: send the pseudo-gradient in their dtype"))
    return unwaited_diagnosis(name, calls)


# --- average_pseudo_gradient ---------------------------------------------------------------------------


def odd_tensors(seed: int, dtype, scale: float = 1.0) -> list[torch.Tensor]:
    """A matrix, a vector and a scalar: shapes that neither divide nor flatten alike."""
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype) for shape in ((3, 5), (7,), ())]


def check_average(checks: Checks, me: Rank) -> bool:
    for dtype in (torch.float32, torch.float64):
        anchor = odd_tensors(1, dtype)
        everyones = [[a - m for a, m in zip(anchor, odd_tensors(10 + r, dtype, 0.1))] for r in range(me.world_size)]
        params = list(Odd(everyones[me.rank]).to(me.device).parameters())  # on the rank's GPU under nccl
        seen = watch(AVERAGE, lab.average_pseudo_gradient, [a.to(me.device) for a in anchor], params,
                     namespaces=lab_namespaces(lab))
        got = [g.cpu() if isinstance(g, torch.Tensor) else g for g in seen.result]
        want = [torch.stack([a - ps[i] for ps in everyones]).mean(0) for i, a in enumerate(anchor)]
        wrong = traffic_mistake("average_pseudo_gradient", seen.calls, params) or seen.problem
        if wrong is None:
            shapes = [(tuple(g.shape), g.dtype) for g in got]
            if shapes != [(tuple(w.shape), w.dtype) for w in want]:
                wrong = (f"average_pseudo_gradient of {dtype} parameters of shapes [(3, 5), (7,), ()] returned "
                         f"{shapes}: one tensor per parameter, its shape and dtype")
            # Tolerance: N additions in another order than the check's: a few ulps (1e-6 float32, 1e-14 float64).
            elif not all(torch.allclose(g, w, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-13)
                         for g, w in zip(got, want)):
                wrong = f"average_pseudo_gradient ({dtype}): " + delta_mistake(got, want, anchor, everyones, me)
        if not checks.settle(wrong):
            return False
    print0("average_pseudo_gradient: the average of anchor - params over the ranks, a matrix, a vector and a "
           "scalar in float32 and float64, the parameters' bytes sent once")
    return True


def delta_mistake(got, want, anchor, everyones, me: Rank) -> str:
    flat = torch.cat([g.reshape(-1) for g in got]).double()
    named = {
        "the pseudo-gradient's sign is flipped (params - anchor): it must point uphill as a gradient does, "
        "anchor - params, so that the outer step (which subtracts it) moves the anchor where the ranks went":
            [-w for w in want],
        f"the pseudo-gradient is {me.world_size}x the average: summed but not divided - ReduceOp.AVG, or divide "
        f"by the world size": [w * me.world_size for w in want],
        f"the pseudo-gradient is 1/{me.world_size} of the average: divided twice (ReduceOp.AVG already divides)":
            [w / me.world_size for w in want],
        "this rank's own pseudo-gradient came back, not the average over the ranks - all-reduce it":
            [a - p for a, p in zip(anchor, everyones[me.rank])],
    }
    for words, guess in named.items():
        if me.world_size > 1 or "sign" in words:
            if torch.allclose(flat, torch.cat([t.reshape(-1) for t in guess]).double(), rtol=1e-5, atol=1e-6):
                return words
    return (f"returned values differ from the average over the ranks of anchor - params by "
            f"{(flat - torch.cat([w.reshape(-1) for w in want]).double()).abs().max():.2e}")


# --- the outer step, against torch.optim.SGD ---------------------------------------------------------


class Odd(nn.Module):
    def __init__(self, values):
        super().__init__()
        self.w, self.b, self.s = (nn.Parameter(v.clone()) for v in values)


MISTAKES = {  # name -> how the outer step differs (the replay below), and what the learner should hear
    "sign": "the anchor moved away from where the ranks went: the pseudo-gradient's sign is flipped "
            "(it is anchor - params, and the step subtracts it)",
    "sum": "the outer step used the SUM of the pseudo-gradients, not their average: summed but not divided",
    "heavy_ball": "the step is the updated buffer itself (momentum * old buf + g): plain momentum without Nesterov's "
                  "look-ahead - or g + momentum * buf with buf read BEFORE this sync updated it, which is the same "
                  "number; Nesterov steps by g + momentum * (the buffer after this sync's update)",
    "momentum_sign": "the momentum term has the wrong sign: the anchor moved by lr * (g - momentum * buf), against "
                     "the direction the momentum has been going - Nesterov adds it",
    "no_momentum": "the momentum buffers are not used: the step is plain SGD on the pseudo-gradient",
    "anchor_stale": "the global copy (the anchor) is not updated: the parameters got the new values but the next "
                    "pseudo-gradient was taken from the old anchor",
    "not_reset": "the local parameters were not reset to the new global ones (params.copy_(anchor)): the ranks "
                 "drift apart",
}


def replay(kind: str, anchor0, moves, lr: float, momentum: float, n: int) -> list[list[list[torch.Tensor]]]:
    """The parameters of every rank after each sync, if the outer step were written as `kind` ("right" or one
    of MISTAKES). moves[k][r]: how far rank r moved in round k (its params = what it started from - moves)."""
    anchor = [a.clone() for a in anchor0]
    start = [[a.clone() for a in anchor0] for _ in range(n)]
    reference = [nn.Parameter(a.clone()) for a in anchor0]
    m = 0.0 if kind == "no_momentum" else momentum
    sgd = torch.optim.SGD(reference, lr=lr, momentum=m, nesterov=m > 0 and kind != "heavy_ball")
    buffers = [torch.zeros_like(a) for a in anchor0]  # momentum_sign's own step, written out
    rounds = []
    for k in range(len(moves)):
        local = [[s - mv for s, mv in zip(start[r], moves[k][r])] for r in range(n)]
        for i, p in enumerate(reference):
            p.data.copy_(anchor[i])
            g = torch.stack([anchor[i] - local[r][i] for r in range(n)]).mean(0)
            p.grad = -g if kind == "sign" else g * n if kind == "sum" else g
            if kind == "momentum_sign":
                buffers[i].mul_(m).add_(g)
                p.data.sub_(g - m * buffers[i], alpha=lr)
        if kind != "momentum_sign":
            sgd.step()
        new = [p.detach().clone() for p in reference]
        if kind != "anchor_stale":
            anchor = new
        start = local if kind == "not_reset" else [[t.clone() for t in new] for _ in range(n)]
        rounds.append([[t.clone() for t in s] for s in start])
    return rounds


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # Tolerance: the average over ranks summed in another order, carried through 3 steps: 1e-5 (float32).
    tol = 1e-12 if a[0].dtype == torch.float64 else 1e-5
    return all(x.shape == y.shape and torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


def check_outer(checks: Checks, me: Rank, dtype, lr: float, momentum: float, rounds: int = 3) -> bool:
    n = me.world_size
    anchor0 = odd_tensors(2, dtype)
    moves = [[odd_tensors(100 * k + r, dtype, 0.1) for r in range(n)] for k in range(rounds)]
    model = Odd(anchor0).to(me.device)  # on the rank's GPU under nccl
    params = list(model.parameters())
    inputs = Inputs(params=params)
    outer = lab.DiLoCo(model, lr=lr, momentum=momentum)
    what = f"DiLoCo(lr={lr}, momentum={momentum}) on {dtype} parameters at {ranks_count(n)}"
    if inputs.changed():
        return checks.settle(f"{what}: building it changed the model's parameters - leave them as they are")
    right = replay("right", anchor0, moves, lr, momentum, n)
    seen, wrong, zeros = [], None, False
    for k in range(rounds):  # every round runs, so that a diagnosis can follow the whole trajectory
        with torch.no_grad():
            for p, mv in zip(params, moves[k][me.rank]):
                p.sub_(mv.to(me.device))  # what this rank's inner steps did
        calls = watch(SYNC, outer.sync, namespaces=lab_namespaces(lab), snapshot=True).calls
        seen.append([p.detach().cpu().clone() for p in params])
        sent = [s.reshape(-1) for c in calls for s in (c.snapshot or [])]
        zeros = zeros or (k == 0 and bool(sent) and not torch.cat(sent).abs().any())
        if wrong is None:
            wrong = traffic_mistake(f"sync() of {what}", calls, params)
        if wrong is None and not close(seen[-1], right[k][me.rank]):
            diff = max((a - b).abs().max().item() for a, b in zip(seen[-1], right[k][me.rank]))
            wrong = (f"{what}: after sync {k + 1} the parameters differ from torch.optim.SGD(nesterov=True) on the "
                     f"averaged pseudo-gradient by {diff:.2e}")
    if wrong is not None and wrong.startswith(what):
        if zeros:
            wrong += (" - the pseudo-gradient it sent was all zeros: the anchor is the model's own parameters "
                      "(no copy), so it moves with them")
        else:
            wrong += " - " + replayed_mistake(seen, anchor0, moves, lr, momentum, n, me.rank, outer, dtype)
    return checks.settle(wrong)


def replayed_mistake(seen, anchor0, moves, lr, momentum, n, rank, outer, dtype) -> str:
    """The known mistake that predicts what this rank saw on every sync, else a neutral hint."""
    held = [t for v in vars(outer).values() if isinstance(v, (list, tuple))
            for t in v if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if any(t.dtype != dtype for t in held):
        other = next(t.dtype for t in held if t.dtype != dtype)
        return (f"the outer state holds {other} tensors for {dtype} parameters: make the anchor and the buffers "
                f"in the parameters' dtype (clone, zeros_like)")
    for kind, words in MISTAKES.items():
        if (kind == "sum" and n == 1) or (kind in ("no_momentum", "heavy_ball", "momentum_sign") and momentum == 0):
            continue
        guess = replay(kind, anchor0, moves[:len(seen)], lr, momentum, n)
        if all(close(s, g[rank]) for s, g in zip(seen, guess)):
            return words
    return "compare your step with SGD's rule: buf = momentum * buf + g; anchor -= lr * (g + momentum * buf)"


# --- training with the lab's loop, and a resume -------------------------------------------------------


def simulate(steps: int, h: int, n: int, zero: bool = True) -> tuple[list[list[torch.Tensor]], list[list[float]]]:
    """Every rank's parameters after `steps` inner steps of AdamW with a DiLoCo sync (torch.optim.SGD) after
    every h-th, and their losses: one process simulating the ranks (zero=False: gradients never zeroed)."""
    models = [lab.make_model() for _ in range(n)]
    inners = [torch.optim.AdamW(m.parameters(), lr=lab.INNER_LR) for m in models]
    anchor = [nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=lab.OUTER_LR, momentum=lab.OUTER_MOMENTUM, nesterov=True)
    data = [list(lab.batches(r, n, steps)) for r in range(n)]
    losses = [[] for _ in range(n)]
    for step in range(steps):
        for r in range(n):
            if zero:
                inners[r].zero_grad()
            loss = F.cross_entropy(models[r](data[r][step][0]), data[r][step][1])
            loss.backward()
            inners[r].step()
            losses[r].append(loss.item())
        if (step + 1) % h == 0:
            for i, a in enumerate(anchor):
                a.grad = torch.stack([a.detach() - list(m.parameters())[i].detach() for m in models]).mean(0)
            outer.step()
            with torch.no_grad():
                for m in models:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
    return [[p.detach().clone() for p in m.parameters()] for m in models], losses


def on(device: torch.device, batches):
    """The batches (x, y) on `device`."""
    return ((x.to(device), y.to(device)) for x, y in batches)


def marked(source, marks: list[int], calls: list):
    """The batches, noting before each one how many calls had been recorded: the calls made during step s
    are calls[marks[s - 1]:marks[s]]."""
    for batch in source:
        marks.append(len(calls))
        yield batch
    marks.append(len(calls))


def check_train(checks: Checks, me: Rank) -> bool:
    h, n = lab.H, me.world_size
    steps = 3 * h + 2  # three whole rounds and a short one: no sync after it
    model = lab.make_model().to(me.device)  # the model and its batches on the rank's GPU under nccl
    inner = torch.optim.AdamW(model.parameters(), lr=lab.INNER_LR)
    outer = lab.DiLoCo(model)
    params = list(model.parameters())
    marks = []
    with Recorder(namespaces=lab_namespaces(lab)) as recorder:
        losses = lab.train(model, inner, outer, marked(on(me.device, lab.batches(me.rank, n, steps)), marks,
                                                      recorder.calls), h)
    per_step = [sum(c.bytes for c in recorder.calls[marks[s]:marks[s + 1]]) for s in range(steps)]
    want_bytes = sum(p.numel() * p.element_size() for p in params)
    syncs = [s + 1 for s, b in enumerate(per_step) if b]
    wrong = None
    if syncs != [h, 2 * h, 3 * h]:
        wrong = (f"train(h={h}) over {steps} inner steps communicated at steps {syncs or 'none'}, expected after "
                 f"steps {h}, {2 * h} and {3 * h} only" + (
                     ": it syncs at every inner step - DDP's traffic, not DiLoCo's" if len(syncs) == steps else
                     ": a sync after the first inner step - the steps counted from 0 (step % h == 0 at step 0); count them from 1"
                     if syncs and syncs[0] == 1 else
                     ": no sync after a last round shorter than h" if len(syncs) > 3 else ""))
    elif any(per_step[s - 1] != want_bytes for s in syncs):
        wrong = f"train(h={h}): each sync must all-reduce the parameters' {want_bytes} bytes once, not {per_step[h - 1]}"
    elif never_waited(recorder.calls):
        wrong = unwaited_diagnosis("train", recorder.calls)
    if wrong is None:
        everyone_params, everyone_losses = simulate(steps, h, n)
        # Tolerance: gloo's sum in another order, carried through AdamW's steps: 1e-5.
        if len(losses) != steps or not torch.allclose(torch.tensor(losses), torch.tensor(everyone_losses[me.rank]),
                                                      rtol=1e-5, atol=1e-6):
            wrong = (f"train returned losses {[round(x, 4) for x in losses[:h + 1]]}..., one process simulating the "
                     f"ranks had {[round(x, 4) for x in everyone_losses[me.rank][:h + 1]]}...")
            summed = simulate(steps, h, n, zero=False)[1][me.rank]
            if len(losses) == steps and torch.allclose(torch.tensor(losses), torch.tensor(summed), rtol=1e-4, atol=1e-5):
                wrong += " - the gradients accumulate over the inner steps: zero the gradients before each backward"
            elif len(losses) != steps:
                wrong += f" - {len(losses)} losses for {steps} inner steps: return one loss per inner step"
        elif not close([p.cpu() for p in params], everyone_params[me.rank]):
            wrong = f"after train({steps} steps, h={h}) the parameters differ from one process simulating every rank"
    if not checks.settle(wrong):
        return False
    print0(f"train: {steps} inner steps of AdamW, a sync after steps {h}, {2 * h} and {3 * h} only ({want_bytes} bytes "
           f"each), the same parameters as one process simulating {ranks_count(n)}")
    return True


def check_resume(checks: Checks, me: Rank) -> bool:
    h, n = lab.H, me.world_size
    steps, stop = 4 * h, 2 * h

    def fresh():
        model = lab.make_model().to(me.device)
        return model, torch.optim.AdamW(model.parameters(), lr=lab.INNER_LR)

    model, inner = fresh()
    outer = lab.DiLoCo(model)
    lab.train(model, inner, outer, on(me.device, lab.batches(me.rank, n, steps)), h)
    straight = [p.detach().clone() for p in model.parameters()]

    model, inner = fresh()
    outer = lab.DiLoCo(model)
    data = on(me.device, lab.batches(me.rank, n, steps))
    lab.train(model, inner, outer, (next(data) for _ in range(stop)), h)
    wrong, buffer = None, io.BytesIO()
    saved = {"anchor": [a.clone() for a in getattr(outer, "anchor", [])],
             "buffers": [b.clone() for b in getattr(outer, "buffers", [])]}
    try:
        torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
    except Exception as error:
        state = None
        wrong = (f"the outer state_dict() could not be saved and read back with torch.load(weights_only=True) "
                 f"({type(error).__name__}: {str(error).split('.')[0][:80]}): keep it to tensors, lists and numbers")
    if state is not None:
        model, inner = fresh()
        outer = lab.DiLoCo(model)  # built first, loaded after: as a script does on a restart
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])
        restored = {name: [t.clone() for t in getattr(outer, name, [])] for name in saved}
        lab.train(model, inner, outer, data, h)
        if not all(torch.equal(a, b) for a, b in zip(model.parameters(), straight)):
            wrong = (f"saved after {stop} of {steps} inner steps and resumed in new objects, the run does not go on "
                     f"as the run that was never stopped")
            if saved["buffers"] and not all(torch.equal(a, b) for a, b in zip(saved["buffers"], restored["buffers"])):
                wrong += ": the momentum state was lost on resume (the buffers after load_state_dict are not the saved ones)"
            elif saved["anchor"] and not all(torch.equal(a, b) for a, b in zip(saved["anchor"], restored["anchor"])):
                wrong += ": the anchor was not restored (after load_state_dict it is not the saved one)"
            else:
                wrong += ": save every tensor the next sync reads, and load it into this object's own tensors"
    if not checks.settle(wrong):
        return False
    print0(f"resume: saved after {stop} inner steps, loaded into new objects, the next {steps - stop} steps bit for "
           f"bit those of the run never stopped")
    return True


def check_on_gpu(checks: Checks, me: Rank) -> bool:
    """DiLoCo run again as on a GPU machine (ringside.effects.on_rank_gpu): the model on this rank's
    stand-in GPU, two syncs, then its state saved and loaded into a new DiLoCo over the same model (the
    state on the model's device, as torch.load(..., map_location=device) reads a checkpoint back), and a
    sync more. Every tensor it keeps, and every parameter, must stay on the model's device. (Keeping the
    loaded tensors themselves, as torch.optim's load_state_dict keeps a momentum buffer already on the
    right device and dtype, is allowed.)"""
    def run(device: torch.device):
        model = Odd(odd_tensors(2, torch.float32)).to(device)
        outer = lab.DiLoCo(model)
        for k in range(2):
            with torch.no_grad():
                for p, mv in zip(model.parameters(), odd_tensors(100 * k + me.rank, torch.float32, 0.1)):
                    p.sub_(mv.to(device))
            outer.sync()
        saved = {key: [t.detach().clone() for t in value] if isinstance(value, list) else value
                 for key, value in outer.state_dict().items()}
        outer = lab.DiLoCo(model)
        outer.load_state_dict(saved)
        with torch.no_grad():
            for p, mv in zip(model.parameters(), odd_tensors(300 + me.rank, torch.float32, 0.1)):
                p.sub_(mv.to(device))
        outer.sync()
        return [t for v in vars(outer).values() if isinstance(v, (list, tuple)) for t in v
                if isinstance(t, torch.Tensor)] + list(model.parameters())

    problem, note = on_rank_gpu("DiLoCo", run, lab.DiLoCo, lab.average_pseudo_gradient,
                                what="a tensor it keeps (the anchor, a momentum buffer or a parameter)")
    if note:
        print0(note)
    return checks.settle(problem)


def main(me: Rank, checks: Checks) -> None:
    torch.set_num_threads(1)
    if not check_average(checks, me):
        return
    for dtype, lr, momentum in ((torch.float32, lab.OUTER_LR, lab.OUTER_MOMENTUM), (torch.float64, 0.5, 0.5),
                                (torch.float32, 1.0, 0.0)):
        if not check_outer(checks, me, dtype, lr, momentum):
            return
    print0("sync: 3 outer steps at (lr, momentum) = (0.7, 0.9), (0.5, 0.5) in float64 and (1, 0) (local SGD), "
           "equal to torch.optim.SGD(nesterov=True) on the averaged pseudo-gradient")
    if check_train(checks, me) and check_resume(checks, me):
        check_on_gpu(checks, me)


def run(**learner) -> None:
    vars(lab).update(learner)
    run_lab(main, title="Lab 17 (diloco)")
