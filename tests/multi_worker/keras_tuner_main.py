"""keras-tuner's getting-started search as its users write it: no keras_dist.

Run unchanged by `keras-dist tune` in test_search_jobs.py; argv[1] is the
tuner's directory; `resume` as argv[2] runs it with overwrite=False.
"""

import sys

import keras
import keras_tuner
import numpy as np

rs = np.random.RandomState(0)
x = rs.rand(512, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("int32")
x_val, y_val = x[:128], y[:128]


def build_model(hp):
    model = keras.Sequential()
    model.add(keras.layers.Dense(
        units=hp.Int("units", min_value=8, max_value=64, step=8),
        activation="relu"))
    model.add(keras.layers.Dense(2, activation="softmax"))
    model.compile(
        optimizer=keras.optimizers.Adam(
            hp.Choice("learning_rate", values=[1e-2, 1e-3])),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"])
    return model


tuner = keras_tuner.RandomSearch(
    build_model,
    objective="val_accuracy",
    max_trials=3,
    executions_per_trial=1,
    overwrite=sys.argv[2:3] != ["resume"],
    directory=sys.argv[1] if len(sys.argv) > 1 else "my_dir",
    project_name="helloworld",
)
tuner.search(x, y, epochs=2, validation_data=(x_val, y_val), verbose=0)
best_model = tuner.get_best_models()[0]
tuner.results_summary()
