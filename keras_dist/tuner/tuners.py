"""keras-tuner's built-in tuners, each trial on a `tf.distribute` strategy.

Same positional arguments, names and defaults as keras-tuner's classes,
plus `DistributedTuner`'s keyword-only `strategy`, `connect_timeout`,
`call_timeout`, `heartbeat_interval` and `worker_timeout`.
"""

import keras_tuner

from keras_dist.distributed_model import distribute
from keras_dist.tuner import _kt_compat
from keras_dist.tuner.distributed_tuner import DistributedTuner


class RandomSearch(DistributedTuner, keras_tuner.RandomSearch):
    """`keras_tuner.RandomSearch`, every trial on a strategy.

    Example:

        ```python
        def build_model(hp):
            model = keras.Sequential([
                keras.Input((64,)),
                keras.layers.Dense(hp.Choice("units", [32, 64]), activation="relu"),
                keras.layers.Dense(10),
            ])
            model.compile(keras.optimizers.Adam(hp.Float("lr", 1e-3, 1e-2)),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            return model

        tuner = keras_dist.tuner.RandomSearch(
            build_model, objective="val_accuracy", max_trials=6,
            directory="search", project_name="digits")
        tuner.search(x, y, epochs=3, validation_split=0.2)
        ```

        Run it as is on one machine, or with `keras-dist tune --num-workers 2
        script.py` to share the trials among 2 tuner workers.
    """


class BayesianOptimization(DistributedTuner, keras_tuner.BayesianOptimization):
    """`keras_tuner.BayesianOptimization`, every trial on a strategy.

    Example:

        ```python
        tuner = keras_dist.tuner.BayesianOptimization(
            build_model, objective="val_loss", max_trials=10, strategy="mirrored")
        ```
    """


class Hyperband(DistributedTuner, keras_tuner.Hyperband):
    """`keras_tuner.Hyperband`, every trial on a strategy.

    Example:

        ```python
        tuner = keras_dist.tuner.Hyperband(
            build_model, objective="val_accuracy", max_epochs=9)
        ```
    """

    def _build_hypermodel(self, hp):
        # keras-tuner's, except that the model is on the strategy before a
        # continued trial's weights are loaded into it: a subclassed model
        # cannot be built for loading otherwise (keras-tuner fails there).
        model = _kt_compat.build_hypermodel(self, hp)
        if self._trial_strategy is not None:
            model = distribute(model, self._trial_strategy)
        if "tuner/trial_id" in hp.values:
            trial_id = hp.values["tuner/trial_id"]
            model.build_from_config(
                _kt_compat.load_json(_kt_compat.build_config_path(self, trial_id))
            )
            model.load_weights(_kt_compat.checkpoint_path(self, trial_id))
        return model


class GridSearch(DistributedTuner, keras_tuner.GridSearch):
    """`keras_tuner.GridSearch`, every trial on a strategy.

    Example:

        ```python
        tuner = keras_dist.tuner.GridSearch(
            build_model, objective="val_accuracy", max_trials=4)
        ```
    """
