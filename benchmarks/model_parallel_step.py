"""Scenario 6: tensor model parallelism (LayoutMapper) vs data parallelism on 4 devices.

The same MLP (64-1024-1024-10, Adam, global batch 256) on the same 4 logical
CPUs, each variant in its own process (a DTensor mesh needs a fresh
TensorFlow), processes alternated: `DistributedModel` on MirroredStrategy
(Keras-style data parallelism), DTensor `batch=4` (data parallel, everything
replicated), `batch=2,model=2` and `model=4` (LayoutMapper's Megatron-style
map). Reports ms per step after a warm-up epoch and the bytes each device
holds, measured from the live variables.
"""

import os
import sys

from benchmarks import _common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_model_parallel_worker.py")
VARIANTS = {
    "MirroredStrategy, 4 replicas (DistributedModel)": "mirrored",
    "DTensor mesh batch=4 (replicated)": "batch=4",
    "DTensor mesh batch=2 x model=2 (LayoutMapper)": "batch=2,model=2",
    "DTensor mesh model=4 (LayoutMapper)": "model=4",
}


def job(variant: str, steps: int, epochs: int) -> dict:
    return _common.result_of([sys.executable, WORKER, "--variant", variant, "--steps",
                              str(steps), "--epochs", str(epochs)], f"variant {variant}")


def run(args) -> dict:
    steps, epochs = (4, 1) if args.quick else (args.steps, 3)
    # --quick: the data-parallel baseline and the fully sharded mesh only.
    variants = {name: v for name, v in VARIANTS.items()
                if not args.quick or v in ("mirrored", "model=4")}
    times = {name: [] for name in variants}
    results = {}
    for _ in range(_common.repeats(args, 3, quick=1)):
        for name, variant in variants.items():
            results[name] = job(variant, steps, epochs)
            times[name] += results[name]["ms_per_step"]
    rows = [
        _common.row(name, times[name],
                    weights_bytes_per_device=results[name]["bytes_variables"],
                    share_of_replicated=results[name]["bytes_variables"]
                    / results[name]["bytes_replicated_variables"],
                    optimizer_bytes_per_device=results[name].get("bytes_optimizer", "-"))
        for name in variants
    ]
    base = rows[0]["median"]
    sharded = rows[-1]  # model=4
    params = next(iter(results.values()))["params"]
    return {
        "id": 6, "name": "model_parallel_step",
        "title": "LayoutMapper (DTensor tensor parallelism) vs data parallelism, 4 devices",
        "setup": (
            f"4 logical CPUs on {os.cpu_count()} cores; MLP 64-1024-1024-10 ({params:,} "
            f"parameters) on digits, Adam, global batch 256, {steps} steps per epoch, "
            f"{epochs} timed epoch(s) per process after a warm-up epoch, processes "
            "alternated."
        ),
        "unit": "ms/step", "rows": rows,
        "ratios": [
            {"name": f"step time, {name} / MirroredStrategy", "value": row["median"] / base}
            for name, row in zip(list(variants)[1:], rows[1:])
        ] + [
            {"name": "weights per device, model=4 / replicated",
             "value": sharded["share_of_replicated"], "goal": "0.25 for the sharded layers"},
        ],
        "notes": "Optimizer bytes for MirroredStrategy are not read per device (-). "
                 "Layers whose size does not divide, the biases of row-parallel layers "
                 "and the 10-way head stay replicated, so the share is above 1/N.",
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    _common.main(run, __doc__, p)
