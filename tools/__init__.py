"""Maintainers' tools, kept out of the learner's package `ringside/`.

- labgen:        write labs/ from solutions/ (`make labs`), and print a lab's hints (`make hint`).
- notebooks:     execute chapter notebooks in place, so their stored outputs are fresh.
- bench:         `make bench`: naive vs ring vs dist.all_reduce on this machine (chapter 04).
- cluster:       `make cluster`, `make cluster-bench`: hosts in network namespaces (root only).
- cluster_bench: the all-reduce measurement that runs on every cluster host.
- gpu_check:     `make test-gpu`: every solution on nccl and the notebooks, on a GPU machine.
- warm_python:   the test suite's `python`: forked from one that imported torch once (conftest.py).
"""
