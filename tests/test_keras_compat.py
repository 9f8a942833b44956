"""Keras / TensorFlow / keras-tuner internals are reached through the compat
modules only, and every internal they rely on still exists (a Keras,
TensorFlow or keras-tuner upgrade that moves one fails here, by name)."""

import ast
import importlib
import inspect
import pathlib

import keras
import keras_tuner as kt
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _keras_compat
from keras_dist.tuner import _kt_compat

PACKAGE = pathlib.Path(keras_dist.__file__).parent
def is_compat(rel: str) -> bool:
    """The compat modules: the `_keras_compat` package and the tuner's."""
    return rel.startswith("_keras_compat/") or rel == "tuner/_kt_compat.py"


# Documented CPython functions that happen to start with an underscore.
STDLIB = {("sys", "_current_frames")}


def framework_objects():
    """Instances and classes whose private names keras_dist must not touch."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)
    attention(tf.zeros([1, 2, 4]), tf.zeros([1, 2, 4]))
    strategy = tf.distribute.get_strategy()
    return [
        model,
        keras.Model,
        keras.layers.Dense(1),
        attention,
        keras.callbacks.Callback(),
        keras.callbacks.ModelCheckpoint("/tmp/unused.keras"),
        keras.callbacks.EarlyStopping(),
        keras.optimizers.SGD(),
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        keras.metrics.Mean(),
        keras.Variable(1.0),
        strategy,
        strategy.extended,
        tf.distribute.MirroredStrategy,
        tf.distribute.MultiWorkerMirroredStrategy,
        kt.Oracle,
        kt.oracles.RandomSearchOracle(),
        kt.Tuner,
        kt.engine.base_tuner.BaseTuner,
        kt.engine.trial.Trial,
        kt.HyperParameters(),
    ]


def private_names(objects) -> set:
    names = set()
    for obj in objects:
        names |= {n for n in dir(obj) if n.startswith("_") and not n.startswith("__")}
    return names


FRAMEWORK = private_names(framework_objects())
OVERRIDES = set(_keras_compat.OVERRIDDEN) | set(_kt_compat.OVERRIDDEN)
COMPUTED = "_computed:"


def library_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        yield rel, ast.parse(path.read_text())


def keras_dist_aliases(tree) -> set:
    """Names a module binds to keras_dist modules (`from keras_dist import _data`)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("keras_dist")
        ):
            aliases |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.startswith("keras_dist")
            }
    return aliases


def private_uses(tree):
    """(line, receiver, name) of every `x._name` and get/set/hasattr(x, "_name")."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            yield node.lineno, node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
        ):
            name = _literal_prefix(node.args[1])
            if name.startswith("_") and not name.startswith("__"):
                yield node.lineno, node.args[0], name


def _literal_prefix(node) -> str:
    """A string argument's value; for an f-string that starts with "_"
    (`f"_{name}_dense"`), COMPUTED + its source: a private name that cannot
    be checked against the framework's, so it is refused outright."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (
        isinstance(node, ast.JoinedStr)
        and node.values
        and isinstance(node.values[0], ast.Constant)
        and str(node.values[0].value).startswith("_")
    ):
        return COMPUTED + ast.unparse(node)
    return ""


def overridden(tree):
    """Private framework methods a keras_dist class defines (overrides)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if item.name in FRAMEWORK:
                        yield item.lineno, node.name, item.name


def test_computed_private_names_are_caught():
    tree = ast.parse('getattr(layer, f"_{name}_dense", None)')
    ((_, _, name),) = list(private_uses(tree))
    assert name.startswith(COMPUTED)


def test_framework_names_are_collected():
    # The check below is only as good as this list.
    assert {"_learning_rate", "_flatten_layers", "_compute_loss", "_retry_queue",
            "_in_multi_worker_mode", "_try_build", "_model"} <= FRAMEWORK


def test_no_private_framework_attribute_outside_the_compat_modules():
    offenders = []
    for rel, tree in library_modules():
        if is_compat(rel):
            continue
        aliases = keras_dist_aliases(tree)
        for line, receiver, name in private_uses(tree):
            if isinstance(receiver, ast.Name) and (
                receiver.id in aliases or (receiver.id, name) in STDLIB
            ):
                continue
            if name in OVERRIDES and ast.unparse(receiver) in ("self", "super()"):
                continue  # keras_dist's own override (pinned below)
            if name in FRAMEWORK or name.startswith(COMPUTED):
                offenders.append(f"{rel}:{line} {ast.unparse(receiver)}.{name}")
    for rel, tree in library_modules():
        if is_compat(rel):
            continue
        offenders += [
            f"{rel}:{node.lineno} {node.value!r} (a private name as a string)"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in FRAMEWORK
        ]
    assert not offenders, (
        "private Keras/TF/keras-tuner attributes outside _keras_compat/ / "
        "tuner/_kt_compat.py (add an accessor there):\n" + "\n".join(offenders)
    )


def test_overridden_framework_methods_are_pinned():
    found = [
        f"{rel}:{line} {cls}.{name}"
        for rel, tree in library_modules()
        for line, cls, name in overridden(tree)
        if name not in OVERRIDES
    ]
    assert not found, (
        "keras_dist overrides these private framework methods without pinning "
        "them in OVERRIDDEN (_keras_compat/__init__.py / tuner/_kt_compat.py):\n"
        + "\n".join(found)
    )


def _built_objects():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)
    attention(tf.zeros([1, 2, 4]), tf.zeros([1, 2, 4]))
    return {
        "keras.Model (compiled)": model,
        "keras.optimizers.Optimizer (built)": optimizer,
        "keras.layers.MultiHeadAttention (built)": attention,
        "keras.Variable": keras.Variable(1.0),
        "keras.callbacks.ModelCheckpoint (built)": keras.callbacks.ModelCheckpoint(
            "/tmp/unused.keras"
        ),
    }


def internal_owner(owner):
    """The object a pinned name belongs to (or its source, for " (source)")."""
    built = _built_objects()
    if owner in built:
        return built[owner]
    path = owner.removesuffix(" (source)")
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        break
    return inspect.getsource(obj) if owner.endswith(" (source)") else obj


@pytest.mark.parametrize(
    "owner, names", sorted(_keras_compat.INTERNALS.items()), ids=lambda v: str(v)[:60]
)
def test_keras_and_tensorflow_internals_still_exist(owner, names):
    obj = internal_owner(owner)
    if isinstance(obj, str):
        missing = [n for n in names if n not in obj]
    else:
        missing = [n for n in names if not hasattr(obj, n)]
    assert not missing, f"{owner}: {missing} gone: update keras_dist/_keras_compat/"


def _overrides():
    table = {**_keras_compat.OVERRIDDEN, **_kt_compat.OVERRIDDEN}
    return sorted((owner, name) for name, owners in table.items() for owner in owners)


@pytest.mark.parametrize("owner, name", _overrides())
def test_overridden_methods_still_exist(owner, name):
    assert callable(getattr(internal_owner(owner), name, None)), (
        f"{owner}.{name} is gone: keras_dist's override no longer takes effect"
    )
