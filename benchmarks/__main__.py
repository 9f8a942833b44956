"""Runs every benchmark scenario against its baseline; writes Markdown and JSON.

Usage: python -m benchmarks [--quick] [--only 1,3] [--repeats N] [--jobs N] [--out DIR]

Each scenario runs in its own process (each needs its own TensorFlow start:
logical CPUs, DTensor, launched workers), interleaving its variants inside
(A B A B ...); every figure is a median with its spread, and every ratio
compares against the alternative measured in the same run. `--quick` runs
each briefly: a smoke test that everything runs and yields numbers, not a
measurement (its scenarios run two at a time).
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks import _common

SCENARIOS = {
    1: "distributed_model_overhead",
    2: "steps_per_execution",
    3: "multi_worker_scaling",
    4: "backup_stall",
    5: "per_replica_overhead",
    6: "model_parallel_step",
    7: "tuner_walltime",
    8: "mixed_precision",
    9: "tf_keras_multi_worker",
    10: "resize_latency",
}
# Scenarios whose jobs take `--gpu` (one GPU per process, NCCL, mixed_float16).
GPU_SCENARIOS = {3, 9}


def machine() -> dict:
    import importlib.metadata as md

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    for package in ("tensorflow", "keras", "keras-tuner"):
        try:
            info[package] = md.version(package)
        except md.PackageNotFoundError:
            info[package] = None
    # GPUs, without starting TensorFlow: what the NVIDIA driver lists.
    smi = shutil.which("nvidia-smi")
    gpus = 0
    if smi:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30,
                                check=False)
        gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    info["gpus"] = gpus
    return info


def summary(results: list[dict], info: dict, quick: bool) -> str:
    lines = [
        "# keras_dist benchmarks" + (" (--quick: smoke run, not a measurement)" if quick
                                     else ""),
        "",
        f"{info['date']}; {info['cores']} cores ({info['processor']}), GPUs: "
        f"{info['gpus']}; Python {info['python']}, TensorFlow {info['tensorflow']}, "
        f"Keras {info['keras']}, keras-tuner {info['keras-tuner']}.",
        "",
        "| # | scenario | key ratio | value | goal |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['id']} | {result['name']} | failed | - | - |")
            continue
        ratio = result["ratios"][0]
        lines.append(f"| {result['id']} | {result['title']} | {ratio['name']} | "
                     f"{ratio['value']:.3f} | {ratio.get('goal', '-')} |")
    lines.append("")
    for result in results:
        if "error" in result:
            lines += [f"### {result['id']}. {result['name']}: failed", "", "```",
                      result["error"][-1500:], "```", ""]
        else:
            lines.append(_common.markdown(result))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="every scenario briefly (CI smoke test)")
    parser.add_argument("--only", default=None,
                        help="comma-separated scenario numbers, e.g. 1,3")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per variant (default: each scenario's)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="scenarios run side by side (default: 2 with --quick, else 1)")
    parser.add_argument("--gpu", action="store_true",
                        help="scenarios 3 and 9 with one GPU per process (NCCL all-reduce, "
                             "mixed_float16) instead of CPU cores")
    parser.add_argument("--out", default=None,
                        help="directory for results.md and results.json (default: "
                             "benchmarks/results, or benchmarks/results/quick with "
                             "--quick, so a smoke run never replaces a measured one)")
    args = parser.parse_args(argv)
    chosen = list(SCENARIOS)
    if args.only:
        try:
            chosen = [int(n) for n in args.only.split(",")]
        except ValueError:
            chosen = None
        if not chosen or any(n not in SCENARIOS for n in chosen):
            parser.error(f"--only takes scenario numbers among {sorted(SCENARIOS)}, "
                         f"comma-separated. Received: --only {args.only}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be a positive integer. Received: {args.repeats}")
    jobs = args.jobs if args.jobs is not None else (2 if args.quick else 1)
    if jobs < 1:
        parser.error(f"--jobs must be a positive integer. Received: {args.jobs}")
    if jobs > 1 and not args.quick:
        print(f"Note: --jobs {jobs} runs scenarios side by side; their timings disturb "
              "each other. Use it for smoke runs, not for the table.", flush=True)
    if args.out is None:
        args.out = os.path.join(_common.ROOT, "benchmarks", "results",
                                *(["quick"] if args.quick else []))
    os.makedirs(args.out, exist_ok=True)
    info = machine()

    def scenario(number: int) -> dict:
        name = SCENARIOS[number]
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "result.json")
            command = [sys.executable, "-m", f"benchmarks.{name}", "--json", path]
            command += ["--quick"] if args.quick else []
            command += ["--repeats", str(args.repeats)] if args.repeats else []
            command += ["--gpu"] if args.gpu and number in GPU_SCENARIOS else []
            start = time.perf_counter()
            print(f"[{number}/{len(SCENARIOS)}] {name}: started at "
                  f"{time.strftime('%H:%M:%S')}", flush=True)
            done = subprocess.run(command, capture_output=True, text=True, check=False,
                                  cwd=_common.ROOT,
                                  env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
            seconds = time.perf_counter() - start
            if done.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
            else:
                result = {"id": number, "name": name,
                          "error": done.stdout[-2000:] + done.stderr[-3000:]}
        result["seconds"] = round(seconds, 1)
        if "error" in result:
            outcome = "failed (the report shows its last output)"
        else:
            ratio = result["ratios"][0]
            outcome = f"done, {ratio['name']} {ratio['value']:.3f}"
        print(f"[{number}/{len(SCENARIOS)}] {name}: {outcome} in {seconds:.0f} s",
              flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(scenario, chosen))
    report = summary(results, info, args.quick)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"machine": info, "quick": args.quick, "scenarios": results}, f, indent=1)
    print(report)
    print(f"Wrote {os.path.join(args.out, 'results.md')} and results.json")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
