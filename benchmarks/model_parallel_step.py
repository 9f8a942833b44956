"""Scenario 6: tensor model parallelism (LayoutMapper), fully sharded data parallelism
(FullySharded) and data parallelism on 4 devices.

The same MLP (64-1024-1024-10, Adam, global batch 256) on the same 4 logical
CPUs, each variant in its own process (a DTensor mesh needs a fresh
TensorFlow), processes alternated: `DistributedModel` on MirroredStrategy
(Keras-style data parallelism), DTensor `batch=4` (data parallel, everything
replicated), `batch=4` with `FullySharded()` (each variable of 1024 elements
or more and its Adam slots split 4 ways, gathered for each step),
`batch=2,model=2` and `model=4` (LayoutMapper's Megatron-style map). Reports
ms per step inside Keras' fit after a warm-up epoch, each fit call's own cost
apart, and for each DTensor mesh the same compiled step driven by a bare loop
(keras_dist's own loop before ShardedModel moved to Keras' fit) in the same
process; the bytes each device holds, measured from the live variables; from
those bytes, the largest model whose weights and Adam state fit an 80 GB GPU
replicated and fully sharded over 4.
"""

import os
import statistics
import sys

from benchmarks import _common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_model_parallel_worker.py")
VARIANTS = {
    "MirroredStrategy, 4 replicas (DistributedModel)": "mirrored",
    "DTensor mesh batch=4 (replicated)": "batch=4",
    "DTensor mesh batch=4 (FullySharded)": "fsdp=4",
    "DTensor mesh batch=2 x model=2 (LayoutMapper)": "batch=2,model=2",
    "DTensor mesh model=4 (LayoutMapper)": "model=4",
}


def job(variant: str, steps: int, epochs: int) -> dict:
    return _common.result_of([sys.executable, WORKER, "--variant", variant, "--steps",
                              str(steps), "--epochs", str(epochs)], f"variant {variant}")


def run(args) -> dict:
    steps, epochs = (4, 1) if args.quick else (args.steps, 3)
    # --quick: the data-parallel baseline, FullySharded and model=4 only.
    variants = {name: v for name, v in VARIANTS.items()
                if not args.quick or v in ("mirrored", "fsdp=4", "model=4")}
    times = {name: [] for name in variants}
    own = {name: [] for name in variants}  # the same steps in a bare loop
    overhead = {name: [] for name in variants}
    results = {}
    for _ in range(_common.repeats(args, 3, quick=1)):
        for name, variant in variants.items():
            results[name] = job(variant, steps, epochs)
            times[name] += results[name]["ms_per_step"]
            own[name] += results[name]["own_loop_ms_per_step"]
            overhead[name] += results[name]["fit_overhead_ms"]
    rows = [
        _common.row(name, times[name],
                    weights_bytes_per_device=results[name]["bytes_variables"],
                    share_of_replicated=results[name]["bytes_variables"]
                    / results[name]["bytes_replicated_variables"],
                    optimizer_bytes_per_device=results[name].get("bytes_optimizer", "-"),
                    fit_call_overhead_ms=statistics.median(overhead[name]))
        for name in variants
    ]
    own_rows = [
        {**row, **_common.row(f"{name}, own loop (the same compiled step, no Keras fit)",
                              own[name]), "fit_call_overhead_ms": "-"}
        for name, row in zip(variants, rows) if own[name]
    ]
    # Keras' fit against the bare loop, epoch by epoch in the same process.
    own_ratios = [
        {"name": f"step time in Keras' fit / own loop, {name}",
         "value": _common.paired_ratio(times[name], own[name]), "goal": "at most 1.1"}
        for name in variants if own[name]
    ]
    base = rows[0]["median"]
    by_variant = {variant: row for row, variant in zip(rows, variants.values())}
    sharded = by_variant["model=4"]
    fsdp = results["DTensor mesh batch=4 (FullySharded)"]
    state_share = ((fsdp["bytes_variables"] + fsdp["bytes_optimizer"])
                   / (fsdp["bytes_replicated_variables"] + fsdp["bytes_replicated_optimizer"]))
    params = next(iter(results.values()))["params"]
    # On paper: float32 weights + Adam's two slots, 12 bytes per parameter
    # replicated; the measured share of it per device fully sharded.
    largest = {"replicated": 80e9 / 12, "fully sharded over 4": 80e9 / (12 * state_share)}
    return {
        "id": 6, "name": "model_parallel_step",
        "title": "LayoutMapper (tensor parallelism) and FullySharded vs data parallelism, "
                 "4 devices",
        "setup": (
            f"4 logical CPUs on {os.cpu_count()} cores; MLP 64-1024-1024-10 ({params:,} "
            f"parameters) on digits, Adam, global batch 256, {steps} steps per epoch, "
            f"{epochs} timed epoch(s) per process after a warm-up epoch, each its own "
            "fit call, timed from its first batch to its last (the call's own start "
            "and end: fit_call_overhead_ms); for each DTensor mesh, the same compiled "
            "step in a bare loop (each batch sliced and copied onto the mesh, the loss "
            "read once per epoch, as keras_dist's own loop did) alternated with those "
            "epochs in the same process; processes alternated."
        ),
        "unit": "ms/step", "rows": rows + own_rows,
        "ratios": [
            {"name": f"step time, {name} / MirroredStrategy", "value": row["median"] / base,
             **({"goal": "at most 0.5"} if "model=4" in name else {})}
            for name, row in zip(list(variants)[1:], rows[1:])
        ] + own_ratios + [
            {"name": "weights per device, model=4 / replicated",
             "value": sharded["share_of_replicated"], "goal": "0.25 for the sharded layers"},
            {"name": "weights + optimizer state per device, FullySharded batch=4 / replicated",
             "value": state_share, "goal": "at most 0.35 (1/4 + 10%)"},
        ],
        "notes": "Optimizer bytes for MirroredStrategy are not read per device (-). "
                 "Layers whose size does not divide, the biases of row-parallel layers "
                 "and the 10-way head stay replicated, so the share is above 1/N. "
                 "Largest model whose float32 weights and Adam state fit an 80 GB GPU "
                 "(on paper, from the measured share; activations, gradients and "
                 "workspace not counted): "
                 + ", ".join(f"{name} {count / 1e9:.1f} B parameters"
                             for name, count in largest.items()) + ".",
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    _common.main(run, __doc__, p)
