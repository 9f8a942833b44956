"""The documentation site builds with warnings as errors, and covers every example."""

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(
    name[:-3] for name in os.listdir(os.path.join(ROOT, "examples"))
    if name.endswith(".py") and not name.startswith("_")
)


def test_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").exists()
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("DistributedModel", "BackupAndRestore", "ResourceMonitor", "average_loss",
                 "LayoutMapper", "DistributedTuner"):
        assert name in reference, name


def test_every_example_has_a_smoke_mode_a_test_and_a_guide():
    tests = open(os.path.join(ROOT, "tests", "test_examples.py")).read()
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    for name in EXAMPLES:
        source = open(os.path.join(ROOT, "examples", f"{name}.py")).read()
        assert '"--smoke"' in source, name
        assert re.search(rf"{name}\.py", tests), f"{name}.py has no test in test_examples.py"
        if name != "quickstart":  # the quickstart is the README's demo
            assert f"guides/{name}.md" in nav, f"{name}.py has no guide page"


def _words(text: str) -> str:
    return " ".join(text.replace("- ", " ").split())


def test_every_guide_says_how_to_run_its_example_as_the_example_does():
    for name in EXAMPLES:
        if name == "quickstart":
            continue
        source = open(os.path.join(ROOT, "examples", f"{name}.py")).read()
        header = source.split('"""')[1]
        run = header.split("\nRun:", 1)[1]
        guide = open(os.path.join(ROOT, "docs", "guides", f"{name}.md")).read()
        assert _words(run) and _words(run) in _words(guide), (
            f"docs/guides/{name}.md does not give the Run: text of examples/{name}.py"
        )


def _source_text(directory: str) -> str:
    """Python sources with adjacent string literals joined, as they print."""
    text = ""
    for path in glob.glob(os.path.join(directory, "**", "*.py"), recursive=True):
        text += open(path).read()
    return re.sub(r"""["']\s*\n\s*f?["']""", "", text)


def test_troubleshooting_quotes_keras_dist_messages_as_they_are():
    page = open(os.path.join(ROOT, "docs", "troubleshooting.md")).read()
    source = _source_text(os.path.join(ROOT, "keras_dist"))
    quoted = re.findall(r"\*\*`(.+?)`\*\* \(keras_dist", page)
    assert len(quoted) >= 8
    for message in quoted:
        for piece in message.split("..."):
            assert piece.strip() in source, f"no longer in keras_dist: {piece.strip()!r}"
