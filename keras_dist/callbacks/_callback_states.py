"""The states of the other callbacks of a fit, as a backup holds them.

A callback's key is its identity: its class and configuration (`monitor`,
`mode`, `filepath`), numbered only among identical ones, so reordering the
callback list does not mix their states up. Callbacks with
`get_state()` / `set_state(state)` are saved through those; Keras' stateful
callbacks through the attributes `_keras_compat.KERAS_CALLBACK_STATE` names
(their `best_weights` as arrays beside the JSON state).
"""

from __future__ import annotations

import os
import re

import numpy as np
import tensorflow as tf

from keras_dist import _keras_compat

LEGACY_KEY = re.compile(r"^\d+:\w+$")
"""Keys of backups written before identities: list position and class."""


def keyed(callbacks, owner, legacy: bool = False) -> list:
    """(key, callback) for every callback of the fit but `owner`.

    `legacy`: the keys of backups written before (list positions).
    """
    found, seen = [], {}
    for index, callback in enumerate(callbacks):
        if callback is owner:
            continue
        if legacy:
            found.append((f"{index}:{type(callback).__name__}", callback))
            continue
        key = identity(callback)
        seen[key] = seen.get(key, 0) + 1
        found.append((key if seen[key] == 1 else f"{key} #{seen[key]}", callback))
    return found


def collect(callbacks, owner) -> tuple[dict, dict]:
    """(JSON states by key, arrays by name) of the callbacks but `owner`."""
    states, arrays = {}, {}
    for key, callback in keyed(callbacks, owner):
        if callable(getattr(callback, "get_state", None)):
            states[key] = callback.get_state()
            continue
        for kind, names in _keras_compat.KERAS_CALLBACK_STATE.items():
            if isinstance(callback, kind):
                states[key] = {n: plain(getattr(callback, n, None)) for n in names}
                weights = getattr(callback, "best_weights", None)
                if weights is not None:
                    for i, w in enumerate(weights):
                        arrays[f"{key}/best_weights/{i}"] = np.asarray(w)
                    states[key]["best_weights"] = len(weights)
    return states, arrays


def apply(callbacks, owner, saved: dict, directory: str) -> None:
    """Gives each callback the state saved under its key (in `directory`)."""
    arrays = None
    legacy = bool(saved) and all(LEGACY_KEY.match(key) for key in saved)
    for key, callback in keyed(callbacks, owner, legacy):
        if key not in saved:
            continue
        values = dict(saved[key])
        if callable(getattr(callback, "set_state", None)):
            callback.set_state(values)
            continue
        count = values.pop("best_weights", None)
        for name, value in values.items():
            setattr(callback, name, value)
        if count is not None:
            if arrays is None:
                arrays = np.load(os.path.join(directory, "arrays.npz"))
            callback.best_weights = [arrays[f"{key}/best_weights/{i}"] for i in range(count)]


def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    """Whether two `collect()` results hold the same states."""
    if a[0] != b[0] or a[1].keys() != b[1].keys():
        return False
    return all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


def identity(callback) -> str:
    cls = type(callback)
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for name in ("monitor", "mode", "filepath"):
        value = getattr(callback, name, None)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            parts.append(f"{name}={value}")
    return " ".join(parts)


def plain(value):
    """JSON-friendly copy of a callback attribute."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, tf.Tensor):
        value = value.numpy().tolist()
    return value
