"""keras-tuner and Keras internals are reached through the compat modules only,
and every keras-tuner internal they rely on still exists (a keras-tuner
upgrade that moves one fails here, by name)."""

import ast
import importlib
import pathlib

import pytest

import keras_dist
from keras_dist.tuner import _kt_compat

PACKAGE = pathlib.Path(keras_dist.__file__).parent
COMPAT = {"_keras_compat", "_kt_compat.py"}  # the Keras package, the tuner's module


@pytest.mark.parametrize("module, names", sorted(_kt_compat.INTERNALS.items()))
def test_keras_tuner_internals_still_exist(module, names):
    loaded = importlib.import_module(module)
    missing = [name for name in names if not hasattr(loaded, name)]
    assert not missing, f"keras-tuner moved {module}.{missing}: update _kt_compat.py"


def test_only_the_compat_modules_import_keras_or_keras_tuner_internals():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT & {path.name, path.parent.name}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [
                f"{path.relative_to(PACKAGE)}:{node.lineno} {name}"
                for name in names
                if name.startswith(("keras.src", "keras_tuner.src"))
            ]
    assert not offenders, offenders
