"""Small models and data shared by the in-process tests."""

import keras
import numpy as np
import tensorflow as tf

_two = {}


def two_replicas() -> tf.distribute.Strategy:
    """A user-made MirroredStrategy over 2 of the 4 logical CPUs."""
    if "s" not in _two:
        _two["s"] = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return _two["s"]


def regression_data(n=72, d=6, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, d).astype("float32")
    y = (x @ rs.randn(d, 1) + 0.1 * rs.randn(n, 1)).astype("float32")
    return x, y


def mlp(batch_norm=False, d=6, seed=1) -> keras.Model:
    """A plain Keras functional MLP with seeded initial weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((d,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model(inputs, outputs)


def optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.Adam(0.02)


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def run_concurrently(commands: dict, jobs: int = 2, timeout: float = 600,
                     cwd: dict | None = None) -> dict:
    """Runs subprocesses `jobs` at a time: {name: argv or [argv, ...]} -> {name: result}.

    For smoke runs whose outcome, not speed, is checked: two at a time use
    both cores of a 2-core runner while each process starts TensorFlow. A
    list of argvs runs in order (later steps depend on earlier ones); the
    result is the last step's, or the first that failed. `timeout` is per
    process; `cwd` maps a name to the directory its processes run in.
    """
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")

    def run(name, steps):
        steps = steps if isinstance(steps[0], list) else [steps]
        for argv in steps:
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False,
                                  cwd=(cwd or {}).get(name))
            if done.returncode:
                break
        return done

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {name: pool.submit(run, name, argv) for name, argv in commands.items()}
        return {name: future.result() for name, future in futures.items()}


class Crash(keras.callbacks.Callback):
    """Raises once the optimizer has taken `at` steps: an in-process kill."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() >= self.at:
            raise RuntimeError("simulated crash")


class RequestCounter:
    """A real HTTP server on 127.0.0.1 that counts the POSTs per path
    (what `keras.callbacks.RemoteMonitor` sends); a context manager."""

    def __enter__(self):
        import collections
        import http.server
        import threading

        counts = self.counts = collections.Counter()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                counts[self.path] += 1
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def by_run(self) -> dict:
        """{"keras_dist" | "plain": [requests of each process that sent any]}."""
        runs: dict = {}
        for path, n in sorted(self.counts.items()):
            runs.setdefault(path.split("/")[1], []).append(n)
        return runs
