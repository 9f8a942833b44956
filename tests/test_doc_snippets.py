"""Every Python snippet of README.md and docs/ runs as a reader copies it.

A snippet is a script of its own (small data defined in it), run in a fresh
process in an empty directory; one whose first line is a "# continues the
example above" comment runs after the snippets before it on its page, as a
reader who copied them in order would; one whose first line is "# run with:
keras-dist launch ... FILE.py" is saved as FILE.py and run with that
command, as the page tells the reader. Pages under docs/guides/ count too;
a block that includes a whole example file (`--8<-- "examples/..."`) is
skipped: the examples are tested by test_examples.py.
"""

import glob
import os
import re
import shlex
import sys

import pytest
from helpers import run_concurrently

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for pattern in ("*.md", "guides/*.md")
    for p in glob.glob(os.path.join(ROOT, "docs", pattern))
)
# A block that includes a whole example file (the example runs in test_examples.py).
INCLUDE = "--8<-- "
CONTINUES = "# continues the example above"
LAUNCHED = re.compile(r"# run with: keras-dist (launch .*?(\S+\.py))\n")


def scripts():
    """{"page#n": source}: one script per snippet that starts a process."""
    found = {}
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        current = None
        for block in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M):
            if block.startswith(INCLUDE):
                continue
            if block.startswith(CONTINUES):
                assert current is not None, f"{page}: the first snippet continues nothing"
                found[current] += "\n" + block
            else:
                current = f"{page}#{sum(k.startswith(page + '#') for k in found) + 1}"
                found[current] = block
    return found


SCRIPTS = scripts()


def test_the_pages_have_snippets():
    assert {name.split("#")[0] for name in SCRIPTS} >= {
        "README.md", "docs/getting_started.md", "docs/backup_and_restore.md",
        "docs/tuner.md", "docs/distributed_model.md", "docs/model_parallel.md",
        "docs/from_keras.md", "docs/guides/fault_tolerance.md", "docs/guides/multi_worker.md",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    commands, cwd = {}, {}
    for name, source in SCRIPTS.items():
        directory = tmp_path_factory.mktemp(re.sub(r"\W", "_", name))
        launched = LAUNCHED.match(source)
        path = directory / (launched.group(2) if launched else "snippet.py")
        path.write_text(source)
        commands[name] = ([sys.executable, "-m", "keras_dist.cli",
                           *shlex.split(launched.group(1))] if launched
                          else [sys.executable, str(path)])
        cwd[name] = str(directory)
    return run_concurrently(commands, timeout=420, cwd=cwd)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_snippet_runs_as_copied(runs, name):
    done = runs[name]
    assert done.returncode == 0, (
        f"{name}:\n{SCRIPTS[name]}\n--- output\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )


def test_the_documented_multi_process_mesh_runs_on_both_workers(runs):
    # docs/model_parallel.md, "One mesh across processes": launched as the
    # page says, each worker prints the bytes its devices hold, the same.
    [name] = [n for n, source in SCRIPTS.items()
              if n.startswith("docs/model_parallel.md") and LAUNCHED.match(source)]
    done = runs[name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = {}
    for line in done.stdout.splitlines():
        match = re.match(r"\[worker (\d)\] (\{'variables'.*\})$", line)
        if match:
            printed[match.group(1)] = match.group(2)
    assert sorted(printed) == ["0", "1"], done.stdout[-3000:]
    assert printed["0"] == printed["1"], printed
