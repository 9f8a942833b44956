"""One process of a distributed search test (chief or tuner worker).

Usage: search_main.py OUT_DIR [key=value ...]
Keys: trials, retries, overwrite (1/0), die (a tuner id), die_at (its Nth
trial), stall (a tuner id that hangs at its die_at-th trial; the other
tuner workers start searching once it has started that trial), sleep
(seconds per trial), worker_timeout.
Every process appends the trial ids it starts to OUT_DIR/runs-<label>.txt;
the chief writes OUT_DIR/summary-<n>.json when the search is over.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

import keras_dist  # noqa: E402, F401  (imported as users write it)
from keras_dist.tuner import RandomSearch  # noqa: E402

import keras  # noqa: E402

out_dir = sys.argv[1]
opts = dict(a.split("=", 1) for a in sys.argv[2:])
tuner_id = os.environ.get("KERASTUNER_TUNER_ID", "tuner0")
chief = "chief" in tuner_id
rank = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
label = f"{tuner_id}-{rank}"
os.makedirs(out_dir, exist_ok=True)

rs = np.random.RandomState(0)
x = rs.randn(64, 6).astype("float32")
y = (x @ rs.randn(6, 1)).astype("float32")


def build(hp):
    if opts.get("unseeded") != "1":
        keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(hp.Int("units", 4, 64), activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-3, 1e-1, sampling="log")),
                  "mse")
    return model


class Search(RandomSearch):
    runs = 0

    def run_trial(self, trial, *args, **kwargs):
        Search.runs += 1
        with open(os.path.join(out_dir, f"runs-{label}.txt"), "a") as f:
            f.write(trial.trial_id + "\n")
        if tuner_id == opts.get("die") and Search.runs == int(opts.get("die_at", 2)):
            os.kill(os.getpid(), signal.SIGKILL)
        if tuner_id == opts.get("stall") and Search.runs == int(opts.get("die_at", 2)):
            time.sleep(3600)  # a trial that hangs
        time.sleep(float(opts.get("sleep", 0)))
        result = super().run_trial(trial, *args, **kwargs)
        weights = sum(float(np.sum(w)) for w in self._last_model.get_weights())
        with open(os.path.join(out_dir, f"weights-{label}.txt"), "a") as f:
            f.write(f"{trial.trial_id} {weights!r}\n")
        return result

    def _try_build(self, hp):
        self._last_model = super()._try_build(hp)
        return self._last_model


tuner = Search(
    build,
    objective="loss",
    max_trials=int(opts.get("trials", 6)),
    max_retries_per_trial=int(opts.get("retries", 0)),
    seed=1,
    directory=out_dir,
    project_name="search",
    overwrite=opts.get("overwrite", "1") == "1",
    heartbeat_interval=0.5,
    worker_timeout=float(opts.get("worker_timeout", 3)),
)
if opts.get("stall") and not chief and tuner_id != opts["stall"]:
    # The other tuner workers ask for trials only once the stalling one
    # hangs in its die_at-th: however late it started (a loaded machine),
    # they cannot finish the search before it has run that many.
    import glob

    def stalled_runs():
        return sum(len(open(path).read().split())
                   for path in glob.glob(os.path.join(out_dir, f"runs-{opts['stall']}-*.txt")))

    deadline = time.monotonic() + 300
    while stalled_runs() < int(opts.get("die_at", 2)) and time.monotonic() < deadline:
        time.sleep(0.1)
start = time.monotonic()
tuner.search(x, y, epochs=2, batch_size=16, verbose=0)
if chief:
    best = tuner.get_best_models(1)[0]
    summary = {
        "seconds": time.monotonic() - start,
        "trials": {t.trial_id: t.status for t in tuner.oracle.trials.values()},
        "best_hp": tuner.get_best_hyperparameters(1)[0].values,
        "best_loss": float(best.evaluate(x, y, verbose=0)),
        "best_score": tuner.oracle.get_best_trials(1)[0].score,
    }
    n = len([f for f in os.listdir(out_dir) if f.startswith("summary-")])
    with open(os.path.join(out_dir, f"summary-{n}.json"), "w") as f:
        json.dump(summary, f)
print(f"{label} done", flush=True)
