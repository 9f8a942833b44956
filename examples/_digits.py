"""The examples' data: 1,797 handwritten digits, shipped in examples/data.

`digits.csv.gz` is the test set of the UCI "Optical Recognition of
Handwritten Digits" data set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0):
one row per image, 64 pixel counts (0..16, an 8x8 image row by row) then
the digit. Nothing is downloaded.
"""

import gzip
import os
from types import SimpleNamespace

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits() -> SimpleNamespace:
    """`.data` (1797, 64) and `.images` (1797, 8, 8): pixel counts 0..16 as
    float64; `.target` (1797,): the digits (the arrays of scikit-learn's
    `load_digits()`, which bundles the same file)."""
    with gzip.open(PATH, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    data = table[:, :-1]
    return SimpleNamespace(data=data, images=data.reshape(-1, 8, 8),
                           target=table[:, -1].astype(int))


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
