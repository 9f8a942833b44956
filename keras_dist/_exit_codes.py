"""Exit statuses keras_dist gives meaning to (shared by workers and launchers)."""

PREEMPTED = 42
"""A process that saved a backup on a preemption signal, then exited."""

HANG = 124
"""A launched job stopped because a worker hung or never joined (as timeout(1))."""
