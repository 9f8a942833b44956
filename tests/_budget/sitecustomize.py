"""Counts the CPU time of every Python process the tests start (conftest.py,
`--cpu-budget`): at exit, one JSON line to $KERAS_DIST_TEST_CPU_LOG naming
the test that started it (pytest's PYTEST_CURRENT_TEST, inherited). A
process killed by a signal writes nothing."""

import atexit
import os


LOG = os.environ.get("KERAS_DIST_TEST_CPU_LOG")


def _record():
    import json
    import resource
    import sys

    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps({
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "cpu": usage.ru_utime + usage.ru_stime,
        "tensorflow": "tensorflow" in sys.modules,
    })
    try:
        with open(LOG, "a") as log:  # one short write per process: lines stay whole
            log.write(line + "\n")
    except OSError:
        pass  # the run's summary is written: a process outliving it is not counted


if LOG:
    atexit.register(_record)
