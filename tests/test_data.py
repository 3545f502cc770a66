"""ringside.data reads scikit-learn's digits file itself (importing scikit-learn costs a second a rank)."""

import numpy as np
import torch

from ringside.data import digits


def test_digits_are_what_load_digits_gives():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x, y = digits(flat=False).tensors
    assert torch.equal(x.reshape(len(x), -1), torch.tensor(bunch.data, dtype=torch.float32) / 16.0)
    assert np.array_equal(y.numpy(), bunch.target) and x.shape == (1797, 1, 8, 8)
