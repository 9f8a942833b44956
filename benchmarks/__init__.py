"""keras_dist benchmarks: each scenario against its baseline, side by side.

Run all: `python -m benchmarks` (from the repository root); one:
`python -m benchmarks.<scenario>`. See benchmarks/README.md.
"""
