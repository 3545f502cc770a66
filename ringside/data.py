"""Data sets that need no download: they ship inside scikit-learn or are made from a seed."""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset


def digits(n: int | None = None, flat: bool = True) -> TensorDataset:
    """scikit-learn's real handwritten digits: 1,797 images of 8x8 pixels, labels 0-9.

    Pixels are scaled to [0, 1]. flat=True gives vectors of 64, else images of 1x8x8.
    n keeps the first n samples (the order is fixed, so every rank sees the same set)."""
    pixels, labels = _digits_file()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    if not flat:
        x = x.view(-1, 1, 8, 8)
    if n is not None:
        x, y = x[:n], y[:n]
    return TensorDataset(x, y)


@functools.cache
def _digits_file() -> tuple[np.ndarray, np.ndarray]:
    """The digits as `sklearn.datasets.load_digits()` gives them (its `data`, its `target`), read from
    the file scikit-learn ships, as it reads it: without importing scikit-learn, which costs about a
    second of CPU in every process (every rank of every lab run)."""
    sklearn = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    with gzip.open(sklearn / "datasets" / "data" / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def digits_split(test_fraction: float = 0.2, flat: bool = True) -> tuple[TensorDataset, TensorDataset]:
    """The digits split into a fixed train and test part (the same split on every rank)."""
    full = digits(flat=flat)
    x, y = full.tensors
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def regression(n: int = 256, features: int = 8, seed: int = 0, noise: float = 0.1) -> TensorDataset:
    """y = x @ w + noise, with x, w and the noise drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + noise * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)
