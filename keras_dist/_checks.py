"""Argument checks shared by the launchers and the tuner."""

from __future__ import annotations

import math
import numbers
import os


def is_positive_int(value) -> bool:
    """An int (Python's or NumPy's, not a bool) above 0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def is_positive_number(value) -> bool:
    """A finite real number (not a bool) above 0."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def check_script(script, kind: str, module: bool = False) -> None:
    if module:
        if not isinstance(script, str) or not _module_exists(script):
            raise ValueError(
                "Invalid value for argument `script` with module=True (-m): "
                f"no module of that name is importable from {os.getcwd()}. "
                f"Received: script={script!r}. Pass a module name such as "
                "`train` or `mypackage.train` (run from the directory that "
                "contains it, or install it)."
            )
        return
    if not isinstance(script, (str, os.PathLike)) or not os.path.isfile(script):
        raise ValueError(
            "Invalid value for argument `script`: no such file. Received: "
            f"script={script!r}. Pass the path of the {kind} script (or a "
            "module name with module=True, -m on the command line)."
        )


def _module_exists(name: str) -> bool:
    """Whether `python -m name`, run from the current directory, finds it."""
    import importlib.util
    import sys

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.remove(os.getcwd())


def check_seconds(name: str, value) -> None:
    if not is_positive_number(value):
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a positive, "
            f"finite number of seconds. Received: {name}={value!r}."
        )


def check_timeout(name: str, value) -> None:
    """None (no limit) or a positive number of seconds."""
    if value is None:
        return
    try:
        check_seconds(name, value)
    except ValueError:
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a positive, finite "
            f"number of seconds, or None for no limit (0 on the command line). "
            f"Received: {name}={value!r}."
        ) from None


def check_log_dir(log_dir) -> None:
    """A directory, or a path whose nearest existing part is a writable one."""
    if log_dir is None:
        return
    existing = os.path.abspath(os.fspath(log_dir))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "it exists" if existing == os.path.abspath(log_dir) else f"{existing!r} exists"
        raise ValueError(
            f"Invalid value for argument `log_dir`: {where} and is not a "
            f"directory. Received: log_dir={log_dir!r}. Pass a directory, or "
            "a path where one can be created."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"Invalid value for argument `log_dir`: {existing!r} is not "
            f"writable by this user. Received: log_dir={log_dir!r}. Pass a "
            "directory you can write to."
        )


# Each worker is a TensorFlow process: about 256 MiB of memory at the least.
_WORKER_MEMORY = 256 * 2**20


def max_local_workers() -> int:
    """How many worker processes this machine can hold at the least cost each."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1024
    return max(1, memory // _WORKER_MEMORY)


def check_local_workers(name: str, value) -> None:
    """A positive count of processes that fits on this machine."""
    check_count(name, value)
    limit = max_local_workers()
    if value > limit:
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected at most {limit} on "
            f"this machine: every worker of a local job is a TensorFlow "
            f"process here, each needs {_WORKER_MEMORY // 2**20} MiB of memory "
            f"or more, and this machine has {limit * _WORKER_MEMORY / 2**30:.0f} "
            f"GiB. Received: {name}={value!r}. Start fewer workers, or spread "
            "them over machines (`hosts`, one launcher per host)."
        )


def check_count(name: str, value, minimum: int = 1) -> None:
    """An integer >= `minimum` (1: positive, 0: non-negative)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative" if minimum == 0 else f">= {minimum}"
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a {kind} "
            f"integer. Received: {name}={value!r}."
        )


def check_launch_arguments(script, kind: str, module: bool, grace_period, log_dir) -> None:
    """What every launcher (`launch`, `launch_search`) checks first."""
    check_script(script, kind, module)
    check_seconds("grace_period", grace_period)
    check_log_dir(log_dir)
