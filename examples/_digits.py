"""The examples' data: scikit-learn's bundled digits (no download)."""

import numpy as np
from sklearn.datasets import load_digits


def load(images: bool = True, test_fraction: float = 0.2):
    """(x_train, y_train), (x_test, y_test): 1,797 8x8 digits, a fixed shuffle.

    `images=True` gives (n, 8, 8, 1) float32 in [0, 1]; False gives (n, 64).
    """
    digits = load_digits()
    x = digits.images[..., None] if images else digits.data
    x = (x / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(round((1 - test_fraction) * len(x)))
    return (x[:split], y[:split]), (x[split:], y[split:])
