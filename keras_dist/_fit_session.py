"""The contract between one `DistributedModel.fit` call and its callbacks.

`DistributedModel.fit` makes one `FitSession` per call and hands it to every
callback that defines `setup_fit(session)` (the one setup hook; Keras' own
callbacks do not define it and are left alone). Through the session a
callback reads what `fit` knows and Keras' callback API does not carry (the
global batch size, the number of samples, the data cursor, the shuffle
seed), contributes to the run (the backup to resume from, a wrapper around
the train step) and registers its clean-up. The model never looks for
callbacks by type and callbacks never read private attributes of the model.

The model's `train_function` is also owned here: it is composed by
`DistributedModel.make_train_function` from the train step and the
session's step wrappers, and everything else that must change it (a
callback that rescales the learning rate, a resumed run that skips the
batches already trained) goes through `invalidate_train_function` or
`TrainFunctionOverride`, for a plain `keras.Model` as well.

See docs/architecture.md for the data flow of one `fit` call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from keras_dist import _data, _keras_compat
from keras_dist._resume import ResumePlan

SETUP_HOOK = "setup_fit"


@dataclasses.dataclass(eq=False)
class StepWrapper:
    """A change to the train step, registered by a callback.

    Attributes:
        owner: The callback that registered it (its identity keys the
            compiled function: a different owner means a retrace).
        wrap: `step -> step`, applied to the replica step function.
        before_input: Optional; called in cross-replica context before each
            step reads its input; returns tensors the read waits for.
        gradient_monitor: Optional; handed to the built-in train step, which
            records the replica's compute time and gradient norm in it.
    """

    owner: Any
    wrap: Callable
    before_input: Callable | None = None
    gradient_monitor: Any = None


class FitSession:
    """What one `fit` call shares with the callbacks that need it.

    Set by `fit` before Keras builds the callback list (read-only for
    callbacks unless said otherwise):

    - `model`, `strategy`, `callbacks` (the list given to `fit`),
      `custom_train_step` (the model overrides `train_step`).
    - `mesh`: the `keras.distribution.DeviceMesh` of a sharded model (one
      step over the whole mesh, no replicas, `keras_dist.dtensor`), else
      None. `strategy` is then what its processes agree through: the
      default strategy on one process, a `_collectives.ProcessGroup` on
      several.
    - `resume` (`_resume.ResumePlan`): the backup this run resumes from,
      or None; written by the callback that restores (`BackupAndRestore`)
      during `setup_fit`, read by `fit` for the epoch it starts at (given
      to Keras' loop as `initial_epoch`) and the shuffle seed.
    - `cursor` (`_data.DataCursor`): which pass over the training input is
      current and how far it is consumed, and the agreed shuffle seed.
    - `num_samples`, `batch_size` (global), `steps_per_epoch`, `dataset`
      (the training input, when it is a `tf.data.Dataset`).
    - `even_batches`: every batch splits evenly over the replicas.
    - `training_data`: `(x, y, sample_weight)` as `fit` trains on them (after
      a `validation_split`), for `data_fingerprint`.
    """

    def __init__(
        self,
        model,
        strategy: tf.distribute.Strategy,
        callbacks,
        *,
        custom_train_step: bool = False,
        mesh=None,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.custom_train_step = custom_train_step
        self.strategy = strategy
        self.callbacks = list(callbacks or [])
        self.resume: ResumePlan | None = None
        self.cursor = _data.DataCursor("unknown", persistent=False)
        self.num_samples: int | None = None
        self.batch_size: int | None = None
        self.steps_per_epoch: int | None = None
        self.dataset: tf.data.Dataset | None = None
        self.even_batches = False
        self.training_data: tuple | None = None
        self._fingerprint: dict | None = None
        self._fingerprinted = False
        self.step_wrappers: list[StepWrapper] = []
        self._roles: dict[str, Any] = {}
        self._teardowns: list[Callable[[], None]] = []

    # -- for callbacks ------------------------------------------------------

    def data_fingerprint(self) -> dict | None:
        """`_data.fingerprint` of the training data (computed once); None
        when `fit` gave none or its kind has none."""
        if not self._fingerprinted:
            data = self.training_data
            self._fingerprint = _data.fingerprint(*data) if data is not None else None
            self._fingerprinted = True
        return self._fingerprint

    def claim(self, role: str, callback) -> None:
        """Makes `callback` the only one of its kind in this fit.

        Raises:
            ValueError: when another callback already claimed `role`.
        """
        if role in self._roles and self._roles[role] is not callback:
            count = sum(isinstance(c, type(callback)) for c in self.callbacks)
            raise ValueError(
                f"Argument `callbacks` holds more than one {type(callback).__name__}. "
                f"Received: {count} of them. Pass a single one."
            )
        self._roles[role] = callback

    def wrap_train_step(
        self,
        owner,
        wrap: Callable,
        *,
        before_input: Callable | None = None,
        gradient_monitor=None,
    ) -> None:
        """Registers a wrapper around the replica train step for this fit."""
        self.step_wrappers.append(
            StepWrapper(owner, wrap, before_input, gradient_monitor)
        )

    def add_teardown(self, function: Callable[[], None]) -> None:
        """Runs `function` when the fit returns or raises (last added, first run)."""
        self._teardowns.append(function)

    # -- for DistributedModel.fit and ShardedModel.fit -------------------------

    def describe_input(self, x, batch_size, steps_per_epoch, training_data) -> None:
        """What the training input tells before any callback runs: the batch
        size, the number of samples (arrays), the cursor's kind, and
        `training_data` (`(x, y, sample_weight)` for `data_fingerprint`)."""
        self.batch_size = batch_size or _data.static_batch_size(x)
        self.cursor = _data.DataCursor(_data.input_kind(x),
                                       persistent=steps_per_epoch is not None)
        self.num_samples = _data.num_samples(x) if self.cursor.kind == "arrays" else None
        self.steps_per_epoch = steps_per_epoch
        self.training_data = training_data

    def track_input(self, x):
        """`x` is what Keras' loop reads: the session's `dataset`. Returns
        the cursor that counts the iterators made on it, or None for input
        that cannot be positioned (a generator, a `PyDataset`)."""
        self.dataset = x if isinstance(x, tf.data.Dataset) else None
        cursor = self.cursor
        if cursor.kind == "dataset" and self.dataset is not None:
            # A pass's draw is replayed on the dataset itself (cheap), when
            # its order depends on the pass at all.
            cursor.undistributed = self.dataset
            cursor.reorders = _keras_compat.reorders_each_pass(self.dataset)
        return cursor if cursor.kind in ("arrays", "dataset") else None


    def set_up(self) -> None:
        """Calls `setup_fit(self)` on every callback that defines it, in order."""
        for callback in self.callbacks:
            hook = getattr(callback, SETUP_HOOK, None)
            if callable(hook):
                hook(self)

    def tear_down(self) -> None:
        """Runs every registered clean-up, even when one of them raises."""
        error = None
        while self._teardowns:
            try:
                self._teardowns.pop()()
            except Exception as e:  # re-raised below, after the others ran
                error = error or e
        if error is not None:
            raise error

    def step_key(self) -> tuple:
        """Identifies the composition: the train function is rebuilt when it changes."""
        return (
            self.even_batches,
            tuple(
                (id(w.owner), id(w.gradient_monitor), w.before_input is not None)
                for w in self.step_wrappers
            ),
        )

    def gradient_monitor(self):
        for wrapper in self.step_wrappers:
            if wrapper.gradient_monitor is not None:
                return wrapper.gradient_monitor
        return None

    def compose(self, step: Callable) -> tuple[Callable, Callable | None]:
        """The step with every wrapper applied, and the combined input hook."""
        hooks = []
        for wrapper in self.step_wrappers:
            step = wrapper.wrap(step)
            if wrapper.before_input is not None:
                hooks.append(wrapper.before_input)
        if not hooks:
            return step, None

        def before_input():
            tensors = []
            for hook in hooks:
                tensors.extend(hook())
            return tensors

        return step, before_input


# -- the one place that changes a model's train_function -----------------------


def invalidate_train_function(model) -> None:
    """The next `fit` (or `make_train_function`) traces the step again."""
    model.train_function = None


def reset_compiled_functions(model) -> None:
    """Drops traced train/test/predict functions (they capture old storage)."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None


class TrainFunctionOverride:
    """Puts a function in place of `model.train_function` until `remove()`.

    `make(original)` returns the replacement; it may call `original`. Used
    by `BackupAndRestore` to skip the batches a resumed run already trained.
    """

    def __init__(self) -> None:
        self._target = None
        self._original = None

    def install(self, model, make: Callable[[Callable], Callable]) -> None:
        self.remove()
        self._target, self._original = model, model.train_function
        model.train_function = make(self._original)

    def remove(self) -> None:
        if self._target is not None:
            self._target.train_function = self._original
            self._target = self._original = None
