"""Argument checks shared by the launchers and the tuner."""

from __future__ import annotations

import numbers
import os


def check_script(script, kind: str) -> None:
    if not isinstance(script, (str, os.PathLike)) or not os.path.isfile(script):
        raise ValueError(
            "Invalid value for argument `script`: no such file. Received: "
            f"script={script!r}. Pass the path of the {kind} script."
        )


def check_seconds(name: str, value) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a positive "
            f"number of seconds. Received: {name}={value!r}."
        )


def check_log_dir(log_dir) -> None:
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(
            "Invalid value for argument `log_dir`: it exists and is not a "
            f"directory. Received: log_dir={log_dir!r}."
        )
