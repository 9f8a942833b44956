"""Scripts as users write them, run as written (one process, and launched).

The README's "Use" snippet under the launcher (tests/test_doc_snippets.py
runs it alone) and a keras.io-style script that opens its own
`strategy.scope()` (with keras_dist first imported inside it) run in fresh
processes, since both depend on what happens at import time.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_use_snippet() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Use"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run(argv, cwd, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done.stdout


@pytest.mark.multi_worker
def test_readme_snippet_runs_under_the_launcher(tmp_path):
    script = tmp_path / "use.py"
    snippet = readme_use_snippet() + textwrap.dedent("""
        weights = sum(float(np.sum(w)) for w in model.get_weights())
        print("WEIGHTS", repr(weights))
        print("LOADED", keras.models.load_model("model.keras").count_params())
    """)
    script.write_text(snippet)
    out = run([sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
               str(script)], tmp_path, timeout=400)
    # The snippet's own print(describe(...)), once per worker.
    printed = re.findall(r"^\[worker (\d)\] MultiWorkerMirroredStrategy: 2 replicas", out,
                         re.M)
    assert sorted(printed) == ["0", "1"], out[-3000:]
    # No alarming TensorFlow start-up line reaches the console.
    assert "Enabling collective ops after program startup" not in out, out[-3000:]
    sums = re.findall(r"WEIGHTS (\S+)", out)
    assert len(sums) == 2 and sums[0] == sums[1], out[-3000:]
    assert len(re.findall(r"LOADED 21", out)) == 2, out[-3000:]


def test_keras_dist_imported_inside_the_users_scope(tmp_path):
    script = tmp_path / "scope.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            import keras
            import keras_dist
            inputs = keras.Input((4,))
            model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
            model.compile("sgd", "mse")
        x = np.ones((32, 4), "float32")
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
        plain = keras_dist.distribute(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
        assert plain.distribute_strategy.num_replicas_in_sync == 2
        plain.compile("sgd", "mse")
        plain.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
        print("OK", model.distribute_strategy is strategy)
    """))
    assert "OK True" in run([sys.executable, str(script)], tmp_path)


def test_a_saved_model_loads_right_after_import_keras_dist(tmp_path):
    import keras

    import keras_dist

    inputs = keras.Input((3,))
    functional = keras_dist.DistributedModel(inputs, keras.layers.Dense(2)(inputs))
    functional.save(tmp_path / "functional.keras")
    sequential = keras_dist.distribute(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    )
    sequential.save(tmp_path / "sequential.keras")
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent("""
        import keras_dist  # nothing else of keras_dist touched
        import keras
        for name in ("functional", "sequential"):
            model = keras.models.load_model(f"{name}.keras")
            print(name, type(model).__name__, model.count_params())
    """))
    out = run([sys.executable, str(script)], tmp_path)
    assert "functional DistributedFunctional 8" in out
    assert "sequential DistributedSequential 8" in out
