"""The jobs of scenarios 3 and 9: one `_fit_worker.py` run per variant.

- `keras_dist(n)`: n workers started by `keras-dist launch`.
- `tf_keras(n)`: the same job in Keras 2 (`tf_keras`), n workers started
  here, each with its own `TF_CONFIG` on 127.0.0.1, in a separate virtual
  environment (`tf_keras_python`).
- `ceiling(n)`: n independent single-worker processes at the same time,
  each with 1/n of the global batch and no communication: the samples/s of
  the n processes together is what n workers could reach at best here.

On CPUs each process gets its share of the cores (intra-op threads =
cores // n, and on 2 cores each is pinned to the core of its rank). With
`gpu=True` each process gets the GPU of its rank instead (keras_dist with
NCCL all-reduce), and mixed precision (`mixed_float16`) is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

from benchmarks import _common

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fit_worker.py")
TF_KERAS_ENV = os.path.join(_common.ROOT, "benchmarks", ".venv-tf-keras")


def _worker_args(n: int, plan: dict, gpu: bool) -> list[str]:
    cores = os.cpu_count() or 1
    threads = max(1, cores // n)
    args = ["--steps", str(plan["steps"]), "--epochs", str(plan["epochs"]),
            "--fits", str(plan["fits"]), "--intra-op-threads", str(threads)]
    if gpu:
        return args + ["--gpu", "--mixed-precision"]
    if threads == 1 and hasattr(os, "sched_setaffinity"):
        args.append("--pin")
    return args


def _env(gpu: bool) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _results(processes, what: str) -> list[dict]:
    results = []
    for process in processes:
        out, err = process.communicate(timeout=900)
        lines = [line for line in out.splitlines() if "RESULT " in line]
        if process.returncode or not lines:
            for other in processes:
                other.kill()
            raise RuntimeError(f"{what} failed ({process.returncode}):\n"
                               + out[-2000:] + err[-2000:])
        results += [json.loads(line.split("RESULT ", 1)[1]) for line in lines]
    return results


def _start(command: list[str], env: dict, tf_config: str | None = None):
    if tf_config is not None:
        env = dict(env, TF_CONFIG=tf_config)
    return subprocess.Popen(command, cwd=_common.ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _chief(results: list[dict]) -> dict:
    return next(r for r in results if r["rank"] == 0)


def keras_dist(n: int, plan: dict, gpu: bool = False, backup: bool = False) -> dict:
    """An n-worker keras_dist job started by `keras-dist launch` (`backup`:
    its long fit again with BackupAndRestore, see `_fit_worker.py`)."""
    script = [WORKER, "--framework", "keras_dist", "--batch", str(plan["batch"]),
              *_worker_args(n, plan, gpu), *(["--backup"] if backup else [])]
    if gpu:
        script += ["--communication", "nccl"]
    if n == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers",
                   str(n), *script]
    return _chief(_results([_start(command, _env(gpu))], f"{n}-worker keras_dist job"))


def tf_keras(n: int, plan: dict, gpu: bool = False) -> dict:
    """The same job in Keras 2 (tf_keras), its n workers started here."""
    from keras_dist import _cluster

    python = tf_keras_python()
    ports = _cluster.loopback_ports(n)
    workers = [f"127.0.0.1:{port}" for port in ports]
    command = [python, WORKER, "--framework", "tf_keras", "--batch", str(plan["batch"]),
               *_worker_args(n, plan, gpu)]
    processes = [_start(command, _env(gpu), _cluster.tf_config(workers, i) if n > 1 else None)
                 for i in range(n)]
    return _chief(_results(processes, f"{n}-worker tf-keras job"))


def ceiling(n: int, plan: dict, gpu: bool = False) -> dict:
    """n single-worker processes at once, each 1/n of the batch, no communication."""
    command = [sys.executable, WORKER, "--framework", "keras",
               "--batch", str(plan["batch"] // n), *_worker_args(n, plan, gpu)]
    processes = [_start(command + ["--rank", str(i)], _env(gpu)) for i in range(n)]
    results = _results(processes, f"{n} independent processes")
    return {"samples_per_second": sum(r["samples_per_second"] for r in results),
            "startup_median_s": max(r["startup_median_s"] for r in results),
            "strategy": "none", "workers": n}


def tf_keras_python() -> str:
    """The Python of a virtual environment holding tf_keras (created on first use).

    tf_keras (Keras 2) is installed there alone, matched to this
    environment's TensorFlow version; TensorFlow itself comes from this
    environment through a `.pth` file, so both frameworks run the same
    TensorFlow build and nothing is installed into the project's environment.
    """
    python = os.path.join(TF_KERAS_ENV, "bin", "python")
    marker = os.path.join(TF_KERAS_ENV, "tf_keras.ready")
    if os.path.exists(marker):
        return python
    import importlib.metadata as md

    version = md.version("tensorflow")
    major_minor = ".".join(version.split(".")[:2])
    subprocess.run([sys.executable, "-m", "venv", "--clear", TF_KERAS_ENV], check=True)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "_keras_dist_parent_env.pth"), "w") as f:
        f.write("\n".join(sorted(parents)) + "\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps",
                    f"tf_keras~={major_minor}.0"], check=True)
    with open(marker, "w") as f:
        f.write(version + "\n")
    return python


def plan(args, steps: int = 30, epochs: int = 4, fits: int = 5) -> dict:
    """Steps, epochs, short fits and global batch of a job (`--quick`: tiny)."""
    if args.quick:
        return {"steps": 4, "epochs": 2, "fits": 2, "batch": args.batch}
    return {"steps": args.steps, "epochs": epochs, "fits": fits, "batch": args.batch}


def measure(args, variants: dict) -> tuple[dict, dict]:
    """Runs the variants' jobs in turn, round after round.

    `variants` maps a row name to `job(plan, gpu) -> result` (e.g.
    `functools.partial(keras_dist, 2)`). Returns `(plan, {name: [result,
    ...]})`.
    """
    job_plan = plan(args)
    if args.gpu:
        check_gpus(2)
    results = {name: [] for name in variants}
    for _ in range(_common.repeats(args, 3, quick=1)):
        for name, job in variants.items():
            results[name].append(job(job_plan, args.gpu))
    return job_plan, results


def rows(results: dict) -> list[dict]:
    """One result row per variant: samples/s, plus the median per-fit start-up."""
    import statistics

    table = []
    for name, runs in results.items():
        startup = [r["startup_median_s"] for r in runs]
        table.append(_common.row(
            name, [r["samples_per_second"] for r in runs],
            startup_s=statistics.median(startup),
            startup_spread=f"{_common.fmt(min(startup))}-{_common.fmt(max(startup))}",
            workers=runs[0]["workers"], strategy=runs[0]["strategy"]))
    return table


def paired(results: dict, a: str, b: str, key: str, key_b: str | None = None) -> float:
    """Median over rounds of variant a's `key` / variant b's (`key_b`, default
    `key`), measured back to back."""
    return _common.paired_ratio([r[key] for r in results[a]],
                                [r[key_b or key] for r in results[b]])


def median(results: dict, name: str, key: str) -> float:
    """Median over rounds of variant `name`'s `key`."""
    import statistics

    return statistics.median(r[key] for r in results[name])


PROTOCOL = (
    "Per step: one long `fit` of {epochs} epochs x {steps} steps, samples/s from the end "
    "of its first epoch to its last batch (epoch boundaries included), timed by a callback. "
    "Start-up: {fits} short `fit` calls of 2 steps on the same model, each call's wall time "
    "minus the time from its first batch's begin to its last batch's end (the chief's "
    "median; `startup_s`). Every job first trains a warm-up `fit` (tracing). Global batch "
    "{batch}; CNN conv3x3(32)-conv3x3(64)-maxpool-dense(128)-10 on digits, Adam. "
)


def threads_note(n: int, gpu: bool) -> str:
    if gpu:
        return "Each process uses the GPU of its rank, mixed_float16; keras_dist all-reduces with NCCL."
    cores = os.cpu_count() or 1
    threads = max(1, cores // n)
    note = (f"{cores} CPU cores: each of the {n} processes sets TensorFlow's intra-op pool to "
            f"{threads} thread(s) and its inter-op pool to 2 before TensorFlow starts")
    if threads == 1 and hasattr(os, "sched_setaffinity"):
        note += ", and is pinned to the core of its rank"
    return note + ". Jobs alternate (A B C A B C ...)."


def check_gpus(n: int) -> None:
    """With `--gpu`: each of the n processes needs a GPU of its own."""
    import shutil

    smi = shutil.which("nvidia-smi")
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30,
                            check=False).stdout if smi else ""
    gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
    if gpus < n:
        sys.exit(f"--gpu runs one process per GPU and needs {n} GPUs; nvidia-smi lists "
                 f"{gpus}. Run without --gpu to measure on the CPU cores.")
