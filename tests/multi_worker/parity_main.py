"""One worker of the 2-worker parity job (tests/parity_cases.py).

Usage: parity_main.py OUT_DIR CASE [CASE ...]
Nothing is seeded. For each case the worker trains through keras_dist on
MultiWorkerMirroredStrategy (the model built with plain Keras first, as
users do) and writes its results to OUT_DIR/rank{R}.npz; worker 0 then
trains plain Keras on one device from the same initial weights (the
chief's, which every worker starts from) and writes those too: each
worker's results are compared with them.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_dist  # noqa: F401  (first, as users write it)

import numpy as np  # noqa: E402
import parity_cases  # noqa: E402

out_dir, names = sys.argv[1], sys.argv[2:]
# Read from TF_CONFIG: the first case runs before any keras_dist call
# creates the strategy. A chief task, or worker 0 where there is none.
config = json.loads(os.environ["TF_CONFIG"])
chief = config["task"]["type"] == "chief" or (
    "chief" not in config["cluster"] and config["task"]["index"] == 0)
if config["task"]["type"] == "evaluator":
    # A managed job's evaluator runs the same script: outside the training
    # cluster, it may evaluate but not train.
    import keras

    info = keras_dist.worker_info()
    model = keras_dist.distribute(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    model.compile("sgd", "mse")
    x = np.ones((8, 2), "float32")
    evaluated = model.evaluate(x, x[:, :1], verbose=0)
    try:
        model.fit(x, x[:, :1], verbose=0)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "evaluator.json"), "w") as f:
        json.dump({"info": [info.num_workers, info.rank, info.is_chief, info.task_type],
                   "strategy": keras_dist.describe(model.distribute_strategy),
                   "evaluated": float(evaluated), "refused": refused}, f)
    sys.exit(0)
results = {}
strategy = None
if names[0] == "--strategy-first":  # the strategy exists before any model
    names = names[1:]
    from keras_dist.strategy import worker_info

    strategy = keras_dist.resolve_strategy("auto")
    rank = worker_info(strategy).rank
for name in names:
    # The first case builds its layers before any keras_dist call creates
    # the strategy; later cases find it cached.
    if name in parity_cases.REFUSED_ON_WORKERS:
        try:
            parity_cases.run_case(name, strategy or "auto")
        except ValueError as error:
            results[f"{name}/refused"] = str(error)
        print(f"case {name} done", flush=True)
        continue
    distributed, plain = parity_cases.run_case(name, strategy or "auto", plain=chief)
    if strategy is None:
        from keras_dist.strategy import resolve_strategy, worker_info

        strategy = resolve_strategy("auto")
        rank = worker_info(strategy).rank
    for key, value in parity_cases.flat(distributed).items():
        results[f"{name}/keras_dist/{key}"] = value
    for key, value in parity_cases.flat(plain or {}).items():
        results[f"{name}/plain/{key}"] = value
    print(f"case {name} done", flush=True)
print(keras_dist.describe(strategy), flush=True)
os.makedirs(out_dir, exist_ok=True)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
