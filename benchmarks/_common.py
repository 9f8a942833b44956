"""Shared pieces of the benchmark scenarios: arguments, interleaving, results.

Every scenario module has `run(args) -> dict` and runs alone as
`python -m benchmarks.<name> [--quick] [--repeats N] [--json PATH]`; the
harness (`python -m benchmarks`) runs each in its own process (each needs its
own TensorFlow start: logical CPUs, DTensor) and gathers their results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parser(doc: str) -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    result.add_argument("--quick", action="store_true",
                        help="a short run (CI smoke test): checks it runs, not speed")
    result.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per variant (default: the scenario's)")
    result.add_argument("--json", default=None, help="also write the result here")
    return result


def main(run: Callable[[argparse.Namespace], dict], doc: str,
         parser_: argparse.ArgumentParser | None = None) -> dict:
    args = (parser_ or parser(doc)).parse_args()
    if args.repeats is not None and args.repeats < 1:
        sys.exit(f"--repeats must be a positive integer. Received: {args.repeats}")
    result = run(args)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def repeats(args, full: int, quick: int = 1) -> int:
    if args.repeats is not None:
        return args.repeats
    return quick if args.quick else full


def interleave(variants: dict[str, Callable[[], float]], rounds: int,
               warmup: int = 1) -> dict[str, list[float]]:
    """Calls each variant in turn (A B A B ...): returns each one's measurements.

    A variant returns the figure it measured (e.g. seconds per step); the
    first `warmup` rounds (tracing, caches) are run and discarded.
    """
    for _ in range(warmup):
        for measure in variants.values():
            measure()
    values = {name: [] for name in variants}
    for _ in range(rounds):
        for name, measure in variants.items():
            values[name].append(float(measure()))
    return values


def row(variant: str, values: list[float], scale: float = 1.0, **extra) -> dict:
    """A result row: median and spread of `values` (times `scale`)."""
    scaled = [v * scale for v in values]
    return {"variant": variant, "median": statistics.median(scaled),
            "min": min(scaled), "max": max(scaled), "samples": len(scaled), **extra}


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of numerator / denominator, each pair measured back to back.

    On a shared machine whose speed drifts between rounds, the ratio within
    a round is steadier than the ratio of the medians.
    """
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def result_of(command: list[str], what: str) -> dict:
    """Runs a benchmark process on the CPU and returns its `RESULT {json}` line."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT, check=False)
    lines = [line for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode or not lines:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n"
                           + done.stdout[-2000:] + done.stderr[-2000:])
    return json.loads(lines[0].split("RESULT ", 1)[1])


def epoch_timer(model, x, y, batch: int, steps: int, **fit_kwargs) -> Callable[[], float]:
    """A variant for `interleave`: one `fit` epoch, in seconds per step."""
    return lambda: timed(lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0,
                                           **fit_kwargs)) / steps


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _examples_digits():
    """examples/_digits.py (the digits of examples/data/digits.csv.gz)."""
    import importlib.util

    path = os.path.join(ROOT, "examples", "_digits.py")
    spec = importlib.util.spec_from_file_location("_examples_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_digits():
    """The examples' digits: `.data`, `.images`, `.target` (see examples/_digits.py)."""
    return _examples_digits().load_digits()


def digits(repeat_to: int | None = None):
    """The bundled handwritten digits (1,797 8x8 images), shuffled once (seed 0)."""
    import numpy as np

    (x, y), _ = _examples_digits().load(images=True, test_fraction=0.0)
    if repeat_to:
        reps = -(-repeat_to // len(x))
        x, y = np.concatenate([x] * reps)[:repeat_to], np.concatenate([y] * reps)[:repeat_to]
    return x, y


def fmt(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def markdown(result: dict) -> str:
    """One scenario's detail table."""
    lines = [f"### {result['id']}. {result['title']}", "", result["setup"], ""]
    unit = result["unit"]
    extra = [k for k in result["rows"][0] if k not in ("variant", "median", "min", "max",
                                                        "samples")]
    header = ["variant", f"{unit} (median)", "spread", "n", *extra]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for r in result["rows"]:
        cells = [r["variant"], fmt(r["median"]), f"{fmt(r['min'])}-{fmt(r['max'])}",
                 str(r["samples"])] + [fmt(r[k]) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for ratio in result["ratios"]:
        goal = f" (goal: {ratio['goal']})" if ratio.get("goal") else ""
        lines.append(f"- {ratio['name']}: **{ratio['value']:.3f}**{goal}")
    if result.get("notes"):
        lines += ["", result["notes"]]
    return "\n".join(lines) + "\n"


def build_model(kind: str, width: int = 256, dtype: str | None = None):
    """The benchmark models on 8x8x1 digits: "mlp" (64-W-W-10) or "cnn" (2 conv + dense)."""
    import keras

    keras.utils.set_random_seed(0)
    if kind == "mlp":
        layers = [keras.layers.Flatten(), keras.layers.Dense(width, activation="relu"),
                  keras.layers.Dense(width, activation="relu")]
    else:
        layers = [keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                  keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                  keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                  keras.layers.Dense(128, activation="relu")]
    # The logits stay float32 under a mixed policy (Keras' advice).
    head = keras.layers.Dense(10, dtype="float32" if dtype else None)
    return keras.Sequential([keras.Input((8, 8, 1)), *layers, head])


MODEL_SIZES = {
    "mlp": "MLP 64-{width}-{width}-10",
    "cnn": "CNN conv3x3(32)-conv3x3(64)-maxpool-dense(128)-10",
}


def compile_model(model, steps_per_execution: int = 1):
    import keras

    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], steps_per_execution=steps_per_execution,
    )
    return model
