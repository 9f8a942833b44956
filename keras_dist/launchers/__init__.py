"""`keras-dist launch` / `keras-dist tune` in layers.

`supervisor` (process group, signals, logs, liveness) -> `train`
(`keras_dist.launch`: restarts, preemption, multi-host) and `search`
(`keras_dist.launch_search`: the oracle chief and tuner workers); the
command line is `keras_dist.cli`.
"""
