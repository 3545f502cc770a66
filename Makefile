# ringside: data-parallel training in PyTorch, by hand and on a laptop.
# `make` alone lists the targets.

SHELL := /bin/bash
.DEFAULT_GOAL := help

# RINGSIDE_VENV: a .venv made elsewhere, used as it is (a workshop hub's learners share the course's)
VENV   := $(or $(RINGSIDE_VENV),.venv)
PY     := $(VENV)/bin/python
# what lab, hint, solution and progress need first: make setup, except on a shared .venv
SETUP  := $(if $(RINGSIDE_VENV),,setup)
NPROC  ?= 4
CH     ?= 00
PORT   ?= 8888
# One OpenMP thread per rank: several ranks share the cores, and torchrun otherwise prints a
# warning (with a time stamp) on every launch.
export OMP_NUM_THREADS ?= 1

# The lab or solution of chapter CH, e.g. CH=04 -> labs/04_ring_allreduce.py
chapter_file = $(firstword $(wildcard $(1)/$(CH)_*.py))
# pip, minus the warnings about package mirrors that this machine's pip.conf names but lacks
PIP = $(PY) -m pip install --quiet 2> >(grep -v "is ignored" >&2)

.PHONY: help setup lab hint solution template test-kernels test-gpu bench-gpu bench-verdicts jupyter test bench labs clean cluster cluster-down cluster-bench cluster-overlap

help: ## list the targets
	@echo "ringside - make targets (CH=NN picks a chapter, NPROC=N the number of ranks):"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 22

# Which torch: the pinned one (requirements.txt) unless
#   TORCH=system       the torch and torchvision that PYTHON already has (a GPU box, a cluster's module):
#                      .venv, made by that Python, finds them there and gets only the rest of requirements.txt;
#   TORCH_PINS="..."   these instead of the pinned pair (make test-oldest-torch: torch 2.11).
# Either way the torch must be in the supported range (tools/torch_range.py), or setup stops and says so.
# Switching an existing .venv: rm -rf .venv first.
PYTHON ?= python3
TORCH  ?= pinned
TORCH_PINS ?=
setup: $(VENV)/.ready ## create .venv with the pinned packages (quick when done already; TORCH=system: use PYTHON's torch)

$(VENV)/.ready: requirements.txt pyproject.toml
	@test "$(TORCH)" = pinned -o "$(TORCH)" = system || { echo "TORCH=$(TORCH): say TORCH=system (the torch PYTHON has) or leave it out (the pinned one)"; exit 2; }
	@if [ "$(TORCH)" = system ]; then $(PYTHON) -m tools.torch_range || exit 1; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# TORCH=system: the folders that hold PYTHON's torch and torchvision join .venv's path (a .pth file)
	@if [ "$(TORCH)" = system ]; then $(PYTHON) -c "import os, torch, torchvision; print(*sorted({os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, torchvision)}), sep='\n')" \
	    > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system-torch.pth"; fi
	grep -v -E '^torch(vision)?==' requirements.txt > $(VENV)/requirements-rest.txt
	$(PIP) -r $(VENV)/requirements-rest.txt $(if $(filter system,$(TORCH)),,$(or $(TORCH_PINS),$(shell grep -E '^torch(vision)?==' requirements.txt)))
	$(PIP) --no-deps --no-build-isolation -e .
	$(PY) -m tools.torch_range
	touch $@

lab: $(SETUP) ## run your lab:       make lab CH=01 NPROC=4
	@test -n "$(call chapter_file,labs)" || { echo "no lab for chapter $(CH) in labs/"; exit 2; }
	@echo "$(call chapter_file,labs) on $(NPROC) ranks, as torchrun --standalone --nproc-per-node $(NPROC) starts them"
	@$(PY) -m ringside $(NPROC) $(call chapter_file,labs)

hint: $(SETUP) ## a hint for your first open TODO, or after a FAIL the next step of its diagnosis: make hint CH=04
	@$(PY) -m tools.labgen --hint $(CH)

solution: $(SETUP) ## run the solution:  make solution CH=01 NPROC=4
	@test -n "$(call chapter_file,solutions)" || { echo "no solution for chapter $(CH)"; exit 2; }
	@echo "$(call chapter_file,solutions) on $(NPROC) ranks, as torchrun --standalone --nproc-per-node $(NPROC) starts them"
	@$(PY) -m ringside $(NPROC) $(call chapter_file,solutions)

# JUPYTER_PATH puts the .venv's kernel first, so "Python 3" is the course's Python even where a
# personal python3 kernel exists; OMP_NUM_THREADS=1 (exported above) reaches the kernel and its
# ranks. It opens the course map (README.md). Several learners on one box: PORT=8890 etc. (a busy
# port makes JupyterLab try the next one and print its address).
template: setup ## run the take-home training script: make template NPROC=4 (see template/README.md)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) template/train_ddp.py --out runs/template

jupyter: setup ## open the course in JupyterLab on 127.0.0.1 (PORT=8888)
	JUPYTER_PATH=$(CURDIR)/$(VENV)/share/jupyter $(VENV)/bin/jupyter lab --ip 127.0.0.1 --port $(PORT) \
	    --ServerApp.root_dir=$(CURDIR) $(if $(filter 0,$(shell id -u)),--allow-root) \
	    $(firstword $(wildcard README.md chapters/00_setup.ipynb))

# The workshop in a real browser (tests/ui/): JupyterLab driven by Playwright in Debian's Chromium
# (/usr/bin/chromium; Playwright's own browser download is not used). NB="a.ipynb ..." tests those
# notebooks instead of chapters/*.ipynb. Minutes, so it is not part of `make test`.
# UI_WORKERS: notebooks run side by side, each worker with its own JupyterLab and Chromium (two halve
# the wait on a 2-core box: much of a notebook's time is ranks waiting on a timeout or on each other).
UI_WORKERS ?= 2
.PHONY: ui-test
ui-test: setup $(VENV)/.ui-ready ## run every chapter in JupyterLab in Chromium (NB=... picks notebooks)
	@test -x /usr/bin/chromium || { echo "make ui-test needs Debian's Chromium: sudo apt-get install -y chromium"; exit 2; }
	@start=$$(date +%s); \
	NB="$(NB)" RINGSIDE_WARM=0 $(PY) -m pytest -q -rs -p no:randomly -p tools.pytest_ui_report -n $(UI_WORKERS) tests/ui/ui_test_workshop.py; status=$$?; \
	echo "make ui-test: total $$(( $$(date +%s) - start )) s"; exit $$status

$(VENV)/.ui-ready: requirements-ui.txt $(VENV)/.ready
	$(PIP) -r requirements-ui.txt
	touch $@

# One pytest session on four workers, notebooks and long tests first: a lab's ranks spend
# much of their time waiting for each other, a deadlock test for its timeout and a notebook for its
# kernel, so more workers than cores keep both cores busy. A notebook's cells stay on one worker
# (see conftest.py); every other test goes to whichever worker is free.
# TEST_WORKERS=0: everything in one process.
TEST_WORKERS ?= 4
NBVAL = -p tools.pytest_quick_imports --nbval --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout 300
# TESTS (and TESTS_K, a -k expression): what to run; every notebook and test unless told otherwise.
TESTS   ?= chapters tests
TESTS_K ?=
test: setup ## run every test: notebooks (nbval), labs, solutions, package
	@start=$$(date +%s); \
	$(PY) -m pytest -q -rs -p no:randomly -n $(TEST_WORKERS) $(NBVAL) $(TESTS) $(if $(TESTS_K),-k "$(TESTS_K)"); status=$$?; \
	echo "make test: total $$(( $$(date +%s) - start )) s"; exit $$status

# What each test costs in CPU-seconds (the suite is bound by CPU on 2 cores), by file and by chapter
# against the budgets in docs/AUTHORING.md; TESTS and TESTS_K as for make test. Needs root (a cgroup).
# COST_JSON=file keeps every test's numbers.
.PHONY: test-cost
test-cost: setup ## what each test costs in CPU-seconds, by file and by chapter, against docs/AUTHORING.md's budgets (root)
	@$(PY) -m tools.test_cost --check $(if $(COST_JSON),--json $(COST_JSON)) -- -q -p no:randomly -n $(TEST_WORKERS) $(NBVAL) \
	    $(TESTS) $(if $(TESTS_K),-k "$(TESTS_K)")

# What can differ with another torch or another CPU's kernels: every notebook's outputs, every
# solution at every world size it accepts (numbers compared bit for bit), the recorder and the stand-in
# GPU (they patch torch), the conformance tests (PyTorch's own as the reference) and the correct
# variants (other torch APIs). Not the planted mistakes again: a check names them the same way.
DIFFERS := chapters tests/test_labs.py tests/test_recorder.py tests/test_standin.py tests/test_conformance.py \
	tests/test_fsdp_conformance.py tests/test_syncbn_options.py tests/test_gpu_traps.py tests/test_data.py \
	tests/test_mutations.py
DIFFERS_K := not test_check_names_the_mistake

# Stored outputs must not depend on the CPU: PyTorch picks its CPU kernels by ATEN_CPU_CAPABILITY,
# so one machine can run the notebooks with another CPU's kernels (default: no SIMD; avx2). CI runs
# this after make test; KERNELS="default" checks one level.
KERNELS ?= default avx2
SOLUTIONS := tests/test_labs.py::test_solution_passes tests/test_labs.py::test_solution_passes_on_two_nodes
test-kernels: setup ## every notebook and solution again under other CPUs' kernels (ATEN_CPU_CAPABILITY=default, avx2)
	@start=$$(date +%s); status=0; \
	for level in $(KERNELS); do \
	    echo "== notebooks and solutions with ATEN_CPU_CAPABILITY=$$level"; \
	    ATEN_CPU_CAPABILITY=$$level $(PY) -m pytest -q -p no:randomly -p no:cacheprovider -n $(TEST_WORKERS) $(NBVAL) \
	        chapters $(SOLUTIONS) tests/test_recorder.py tests/test_standin.py || status=1; \
	done; \
	echo "make test-kernels: total $$(( $$(date +%s) - start )) s"; exit $$status

# The GPU check runs with the Python and torch the machine already has (GPU_PY=... to choose; the
# course's .venv when it exists) and installs nothing: a GPU box may have no network.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu: ## (GPU machine) every solution on nccl, every notebook, the capstone's restart
	@$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; status=$$?; \
	if [ $$status = 3 ]; then echo "make test-gpu: no CUDA GPU on this machine ($(GPU_PY)): nothing to check."; exit 0; fi; \
	if [ $$status != 0 ] && ! command -v nvidia-smi >/dev/null; then echo "make test-gpu: no CUDA GPU on this machine (no torch in $(GPU_PY), no nvidia-smi): nothing to check."; exit 0; fi; \
	if [ $$status != 0 ]; then echo "make test-gpu: $(GPU_PY) cannot import torch (GPU_PY=... names another Python)"; exit 2; fi; \
	start=$$(date +%s); \
	RINGSIDE_WARM=0 PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -rs -p no:randomly -p no:cacheprovider tests/gpu \
	    tests/test_template.py -k gpu; status=$$?; \
	echo "make test-gpu: $$($(GPU_PY) -c 'import torch; print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), "- torch", torch.__version__)'), total $$(( $$(date +%s) - start )) s"; \
	exit $$status

progress: $(SETUP) ## your labs' latest verdicts (every `make lab` run is recorded)
	@$(PY) -c 'import sys, ringside.progress as p; sys.exit(p.main())'

# A workshop room on one machine (tools/hub.py, hub/jupyterhub_config.py; root): JupyterHub on
# 127.0.0.1:HUB_PORT for LEARNERS (Linux users it creates), a shared PASSWORD (random if empty),
# each learner bounded to HUB_CPUS cores and HUB_MEMORY_GB in cgroups of their own.
# SPAWNER=slurm: each learner's server is a Slurm job instead (batchspawner), on the cluster sbatch
# reaches (SLURM_CONF), bounded by Slurm to the same; PARTITION, TIME (each server's limit) and
# SBATCH_OPTIONS (e.g. --account=ws) for sbatch, HUB_IP where the nodes reach this machine.
# `make slurm-node` starts a one-node Slurm here to try it (docs/INSTRUCTORS.md).
LEARNERS ?= learner1 learner2 learner3 learner4
HUB_PORT ?= 8000
HUB_CPUS ?= 1
HUB_MEMORY_GB ?= 2
SPAWNER ?= local
PARTITION ?=
TIME ?=
SBATCH_OPTIONS ?=
HUB_IP ?= 127.0.0.1
.PHONY: hub hub-down room hub-test progress slurm-node slurm-down
hub: setup $(VENV)/.hub-ready ## (root) a workshop room: JupyterHub for LEARNERS="a b ..." on 127.0.0.1:HUB_PORT (SPAWNER=slurm: servers as Slurm jobs)
	$(PY) -m tools.hub up --learners "$(LEARNERS)" --port $(HUB_PORT) --cpus $(HUB_CPUS) --memory-gb $(HUB_MEMORY_GB) \
	    --spawner $(SPAWNER) --partition "$(PARTITION)" --time "$(TIME)" --slurm-options "$(SBATCH_OPTIONS)" --hub-ip $(HUB_IP) \
	    $(if $(PASSWORD),--password "$(PASSWORD)")

hub-down: ## (root) stop the hub; remove its learners, their cgroups and files
	$(PY) -m tools.hub down

room: setup ## (root) the instructor's live table: every learner's latest verdict per lab
	$(PY) -m tools.hub room

slurm-node: ## (root) a one-node Slurm on this machine, to try SPAWNER=slurm (prints the SLURM_CONF to export)
	$(PY) -m tools.slurm_node up

slurm-down: ## (root) stop the one-node Slurm and remove its folder
	$(PY) -m tools.slurm_node down

$(VENV)/.hub-ready: requirements-hub.txt $(VENV)/.ready
	$(PIP) -r requirements-hub.txt
	touch $@

# K learners at once in Chromium: log in, run chapter 00, pass lab 00 from a terminal; files kept apart.
# SPAWNER=slurm: through a one-node Slurm the test starts (tools/slurm_node.py), each server a job.
HUB_LEARNERS ?= 4
hub-test: setup $(VENV)/.ui-ready $(VENV)/.hub-ready ## (root) the room in a real browser: HUB_LEARNERS learners at once (SPAWNER=slurm: as Slurm jobs)
	@test -x /usr/bin/chromium || { echo "make hub-test needs Debian's Chromium: sudo apt-get install -y chromium"; exit 2; }
	@start=$$(date +%s); \
	HUB_LEARNERS=$(HUB_LEARNERS) HUB_SPAWNER=$(SPAWNER) RINGSIDE_WARM=0 $(PY) -m pytest -q -rs -p no:randomly -p no:cacheprovider tests/hub/hub_test_room.py; status=$$?; \
	echo "make hub-test: total $$(( $$(date +%s) - start )) s"; exit $$status

bench-gpu: ## (GPU machine) chapter 09's table: step time and memory in fp32, TF32, fp16, bf16
	@PYTHONPATH=$(CURDIR) $(GPU_PY) tools/amp_bench.py

bench: setup ## time naive vs ring vs dist.all_reduce; writes assets/bench/
	$(PY) -m tools.bench

bench-verdicts: setup ## each lab's time to its verdict at 2 and 4 ranks, on an idle machine (LABS="04 11": those)
	$(PY) -m tools.verdict_bench $(LABS)

N    ?= 4
RATE ?= 1gbit
cluster: setup ## (root) N hosts in network namespaces, RATE links: make cluster N=4 RATE=1gbit
	$(PY) -m tools.cluster up --hosts $(N) --rate $(RATE)

cluster-down: ## (root) remove the simulated cluster
	$(PY) -m tools.cluster down

HOSTS ?= 2,3,4
cluster-bench: setup ## (root) naive vs ring vs all_reduce on 2, 3 and 4 hosts (HOSTS=2,3,4); writes assets/cluster/
	$(PY) -m tools.cluster bench --rate $(RATE) --hosts $(HOSTS)

cluster-overlap: setup ## (root) chapter 12: a DDP step with and without overlap on 2 hosts, RATE links; writes assets/cluster/overlap.json
	$(PY) -m tools.overlap_bench --rate $(RATE)

.PHONY: cluster-fsdp
cluster-fsdp: setup ## (root) chapter 16: a ZeRO-3 step with and without prefetching on 2 hosts, RATE links; writes assets/16_fsdp/cluster.json
	$(PY) -m tools.fsdp_bench --rate $(RATE)

.PHONY: cluster-diloco
cluster-diloco: setup ## (root) chapter 17: DDP, local SGD and DiLoCo trained on 4 hosts at 100mbit and 1gbit links; writes assets/17_diloco/cluster.json
	$(PY) -m tools.diloco_bench --rates 100mbit,1gbit --hosts 4

.PHONY: cluster-hierarchy
cluster-hierarchy: setup ## (root) chapter 15: links, flat vs hierarchical all-reduce, DDP/FSDP/HSDP steps on 2 and 4 hosts x 2 ranks; writes assets/15_hierarchy/cluster.json
	$(PY) -m tools.hierarchy_bench --rate $(RATE) --reps 7

# The oldest torch the course supports, in a second environment beside .venv: what can differ there
# (DIFFERS, above), and the take-home template (torch's checkpoints, FSDP and torchrun's restarts).
OLDEST_TORCH_PINS := torch==2.11.0 torchvision==0.26.0
.PHONY: test-oldest-torch
test-oldest-torch: ## notebooks, solutions, template and what else can differ, on the oldest supported torch (2.11), in .venv-torch2.11 (4 GB)
	$(MAKE) --no-print-directory test VENV=.venv-torch2.11 TORCH_PINS="$(OLDEST_TORCH_PINS)" \
	    TESTS="$(DIFFERS) tests/test_template.py" TESTS_K="$(DIFFERS_K)"

labs: setup ## regenerate labs/ from solutions/ (maintainers; overwrites labs/)
	$(PY) -m tools.labgen

clean: ## remove caches and run outputs (keeps .venv)
	rm -rf runs checkpoints .pytest_cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
