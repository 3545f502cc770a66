"""Every solution passes its own check; every lab stub fails cleanly and says which TODO is open."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, launch, solutions, stem_ids

from mutation import nprocs, refuses, slow, two_nodes

from ringside.lab import pass_line, ranks_label
from tools.labgen import expected_labs


def nproc_cases():
    for path in solutions():
        for nproc in nprocs(path.stem):
            yield pytest.param(path, nproc, id=f"{path.stem}-{nproc}ranks",
                               marks=[pytest.mark.slow] if slow(path.stem) else [])


@pytest.mark.parametrize("solution, nproc", list(nproc_cases()))
def test_solution_passes(solution, nproc):
    # Ranks are forked (fork_script: no `import torch` per rank). The real torchrun runs a lab in
    # chapter 11's notebook (the capstone at 1, 2 and 4 ranks), the template and chapter 00's scripts.
    result = launch(solution, nproc)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{solution.name} failed on {nproc} ranks:\n{out[-4000:]}"
    assert pass_line(nproc) in result.stdout
    assert f"{ranks_label(list(range(nproc)))}: PASS (" in result.stdout and "FAIL" not in result.stdout


@pytest.mark.parametrize("solution", [s for s in solutions() if two_nodes(s.stem)], ids=lambda p: p.stem)
def test_solution_passes_on_two_nodes(solution):
    """2 nodes x 2 ranks, numbered as torchrun numbers them: ranks 2 and 3 have LOCAL_RANK 0 and 1,
    so code that takes the global rank for the local one (a device index, once-per-node work) or
    works on rank 0 only is run where it differs."""
    result = launch(solution, 2, nnodes=2)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{solution.name} failed on 2 nodes x 2 ranks:\n{out[-4000:]}"
    assert pass_line(4) in result.stdout


@pytest.mark.slow
def test_lab_00_under_two_real_torchrun_agents():
    """The forked two-node runs above number ranks as torchrun does; here two real torchrun agents
    meet at a c10d rendezvous, as on two machines (chapter 05), and lab 00 checks each rank's LOCAL_RANK."""
    from ringside.rendezvous import simulate_nodes

    nodes = simulate_nodes(ROOT / "solutions" / "00_setup.py", nnodes=2, nproc=2, timeout=180)
    out = "".join(node.stdout + node.stderr for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], out[-4000:]
    assert pass_line(4) in out


@pytest.mark.slow
def test_lab_05_under_torchrun_forms_every_group():
    """Under torchrun (not forked ranks) the ranks get TORCHELASTIC_USE_AGENT_STORE, which torch 2.11
    applies to a tcp:// address too: lab 05's tcp:// group timed out there (REVIEW A)."""
    result = launch(ROOT / "solutions" / "05_init_methods.py", 2, torchrun=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "tcp:// formed a group of 2" in result.stdout and pass_line(2) in result.stdout


def test_make_lab_shows_a_refusal_as_one_line_without_torchrun_report():
    """`make lab CH=10 NPROC=1` (python -m ringside): the learner sees why and what to run, not
    torchrun's ChildFailedError report under it."""
    from ringside.launch import quiet_env

    result = subprocess.run([sys.executable, "-m", "ringside", "1", "solutions/10_dist_eval.py"], cwd=ROOT,
                            env=quiet_env(), capture_output=True, text=True, timeout=180)
    said = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(said) == 1, result.stderr[-3000:]
    assert said[0].startswith("Lab 10 (dist_eval) cannot check 1 rank: ") and "use --nproc-per-node 2" in said[0]


def refusal_cases():
    for path in solutions():
        for nproc in refuses(path.stem):
            yield pytest.param(path, nproc, (), id=f"{path.stem}-{nproc}ranks")
    yield pytest.param(ROOT / "solutions" / "15_hierarchy.py", 3, ("--ranks-per-host", "2"),
                       id="15_hierarchy-3ranks-2per_host")


@pytest.mark.parametrize("solution, nproc, args", list(refusal_cases()))
def test_a_size_the_check_cannot_tell_is_refused_in_one_line(solution, nproc, args):
    """Refused before anything runs, in one line that says why and what to run instead; never a
    PASS that proves nothing (lab 10 at 1 rank) nor the learner's own error as a FAIL."""
    result = launch(solution, nproc, *args)
    assert result.returncode != 0
    said = result.stderr.strip().splitlines()
    assert len(said) == 1 and " cannot check " in said[0] and "use --" in said[0], result.stderr[-2000:]
    assert "PASS" not in result.stdout and "FAIL" not in result.stdout


@pytest.mark.parametrize("solution", solutions(), ids=stem_ids(solutions()))
def test_lab_stub_fails_with_its_todo(solution):  # at the smallest size it accepts
    lab = ROOT / "labs" / solution.name
    first_todo = next(line.split("# TODO: ", 1)[1] for line in lab.read_text().splitlines() if "# TODO: " in line)
    nproc = nprocs(solution.stem)[0]
    result = launch(lab, nproc)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"FAIL - unfinished - TODO: {first_todo}" in result.stdout
    assert " FAIL: fix the first message above" in result.stdout


def test_every_lab_is_generated_from_its_solution():
    drift = [p.name for p, text in expected_labs(ROOT).items() if not p.exists() or p.read_text() != text]
    assert not drift, f"labs/ differs from its solutions (run `make labs`): {drift}"
    assert sorted(p.name for p in (ROOT / "labs").glob("[0-9][0-9]_*.py")) == [p.name for p in solutions()]


@pytest.mark.parametrize("solution", solutions(), ids=stem_ids(solutions()))
def test_lab_ends_through_run_lab(solution):
    """A lab ends by handing its functions to its check, checks/labNN.py, whose run() ends through
    run_lab (clean teardown, os._exit), never a bare main(); the lab file holds no check code."""
    number = solution.name[:2]
    text = solution.read_text()
    assert f'if __name__ == "__main__":  # the check is in checks/lab{number}.py' in text
    assert f"    from checks import lab{number}\n    lab{number}.run(" in text
    check = (ROOT / "checks" / f"lab{number}.py").read_text()
    assert "\ndef run(**learner) -> None:" in check and "    run_lab(" in check
    assert "checks.expect(" not in text and "import checks" not in text


# A whole `make lab` as on a GPU machine (ringside.gpubox): every rank's default group nccl (gloo
# underneath), its tensors on stand-in GPUs, and every collective - the check's own too - refused as
# NCCL refuses a tensor not on the rank's GPU. Two cheap labs here; any lab by hand:
# RINGSIDE_GPU_BOX=1 python -m ringside 2 solutions/NN_x.py
GPU_BOX = {"RINGSIDE_GPU_BOX": "1"}


@pytest.mark.parametrize("stem", ["07_syncbn", "18_batch_scaling"])  # their checks once crashed on nccl
def test_solution_passes_as_on_a_gpu_machine(stem):
    result = launch(ROOT / "solutions" / f"{stem}.py", 2, env=GPU_BOX)
    assert result.returncode == 0 and pass_line(2) in result.stdout, (result.stdout + result.stderr)[-4000:]


def test_gpu_machine_rehearsal_refuses_a_cpu_tensor_in_a_collective(tmp_path):
    """The planted case: a script (a check, say) that all-reduces a CPU tensor on the default group
    crashes on a GPU machine, where that group is nccl; gloo here would take it."""
    script = tmp_path / "cpu_collective.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "from ringside.runtime import init_distributed\n"
                      "me = init_distributed()\n"
                      "print(me.backend, me.device, flush=True)\n"
                      "dist.all_reduce(torch.ones(2, device=me.device))  # on the rank's GPU: fine\n"
                      "dist.all_reduce(torch.ones(2))\n")
    result = launch(script, 2, env=GPU_BOX)
    assert result.returncode == 1 and "nccl cuda:1" in result.stdout
    assert "dist.all_reduce got `tensor` on cpu, not on this rank's GPU cuda:1: NCCL refuses it" in result.stderr
    assert "No backend type associated with device type cpu" in result.stderr


def test_plain_python_says_how_to_run_and_exits_2():
    lab = ROOT / "labs" / solutions()[0].name
    result = subprocess.run([sys.executable, str(lab)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "torchrun --standalone --nproc-per-node" in result.stderr
    assert "Traceback" not in result.stderr


def test_lab14_broken_job_shows_every_rank_where_it_is():
    """`--broken job2` runs the job as handed over: DETAIL names the collective that differs and each
    rank's sizes, in one line per rank, and the run ends with what to look at (exit 0, no torchrun
    failure report): the learner's tool, not a verdict."""
    result = launch(ROOT / "solutions" / "14_debugging.py", 4, "--broken", "job2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ranks 0-2: TORCH_DISTRIBUTED_DEBUG=DETAIL: collective #0 differs across ranks" in result.stdout
    assert "rank 3: TORCH_DISTRIBUTED_DEBUG=DETAIL: collective #0 differs across ranks; this rank calls allgather of [248]" in result.stdout
    assert "Find the rank that is not where the others are" in result.stdout
