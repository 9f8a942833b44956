"""The benchmark harness runs every scenario end to end (`--quick`: no timing asserted)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def harness(*args, timeout=900):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.multi_worker
def test_quick_run_produces_every_scenario(tmp_path):
    done = harness("--quick", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    with open(tmp_path / "results.json") as f:
        report = json.load(f)
    assert report["quick"] is True
    assert report["machine"]["cores"] == os.cpu_count()
    scenarios = report["scenarios"]
    assert [s["id"] for s in scenarios] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    for scenario in scenarios:
        assert "error" not in scenario, scenario
        assert scenario["setup"] and scenario["unit"]
        assert len(scenario["rows"]) >= 2, scenario["name"]
        for row in scenario["rows"]:
            assert row["samples"] >= 1
            for key in ("median", "min", "max"):
                assert math.isfinite(row[key]), (scenario["name"], row)
            assert row["min"] <= row["median"] <= row["max"]
        for ratio in scenario["ratios"]:
            assert math.isfinite(ratio["value"]), ratio
            if ratio["name"].startswith("host round trips per step beyond"):
                # No collective of keras_dist's runs between two steps of
                # an epoch, BackupAndRestore's preemption handling included.
                assert ratio["value"] == 0, ratio
            elif not ratio["name"].startswith("whole fit's cost per save"):
                # A difference of wall times: a quick run's few saves can
                # measure one below the noise (seen: negative).
                assert ratio["value"] > 0, ratio
    markdown = (tmp_path / "results.md").read_text()
    for scenario in scenarios:
        assert f"### {scenario['id']}. {scenario['title']}" in markdown
    # Scenario 6 measured the shards: model=4 holds about a quarter.
    mesh = {row["variant"]: row for row in scenarios[5]["rows"]}
    share = mesh["DTensor mesh model=4 (LayoutMapper)"]["share_of_replicated"]
    assert 0.25 <= share < 0.3
    # FullySharded over batch=4: weights and Adam state about a quarter.
    assert 0.25 <= mesh["DTensor mesh batch=4 (FullySharded)"]["share_of_replicated"] <= 0.35
    [state] = [r for r in scenarios[5]["ratios"] if r["name"].startswith("weights + optimizer")]
    assert 0.25 <= state["value"] <= 0.35, state


@pytest.mark.parametrize("args, message", [
    (["--only", "11"],
     "--only takes scenario numbers among [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"),
    (["--only", "a,b"], "Received: --only a,b"),
    (["--repeats", "0"], "--repeats must be a positive integer. Received: 0"),
    (["--jobs", "0"], "--jobs must be a positive integer. Received: 0"),
])
def test_bad_arguments_are_refused_before_running(args, message, tmp_path):
    done = harness(*args, "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quick, epochs_at, epochs", [
    (False, [10, 1000], [10, 1000]),  # a full run
    (False, [10, 10], [10]),  # one epoch, given twice
    (True, [10, 1000], [2]),  # --quick resumes at epoch 2 only
])
def test_the_elastic_scenario_compares_epochs_only_when_it_resumed_at_two(
        monkeypatch, quick, epochs_at, epochs):
    """Scenario 10's figures and ratios from its rounds (the launched jobs
    replaced by known figures): between epochs only with two starting
    epochs; within an epoch always."""
    import argparse

    from benchmarks import resize_latency

    names = ["launch: command to first step", "preemption: signal to next step",
             "grow: launcher's decision to first step of 2 workers",
             "SIGKILL: signal to next step",
             "by hand: signal to first step of the restarted job",
             "one process, no launcher: command to first step"]
    rounds = []

    def one_round(epoch, quick):
        rounds.append(epoch)
        return {name: (i + 1) * (2.0 if epoch == 1000 else 1.0) for i, name in enumerate(names)}

    monkeypatch.setattr(resize_latency, "one_round", one_round)
    result = resize_latency.run(argparse.Namespace(quick=quick, epochs_at=epochs_at, repeats=1))
    assert rounds == epochs
    assert [r["variant"] for r in result["rows"]] == [
        f"{name} (epoch {e})" for name in names for e in epochs]
    ratios = {r["name"]: r["value"] for r in result["ratios"]}
    high = epochs[-1]
    expected = {f"start-up, launch of 2 workers / one process: command to first step "
                f"(epoch {high})": 1 / 6,
                f"preemption to next step over a stop and restart by hand (epoch {high})": 2 / 5}
    if len(epochs) == 2:  # every figure doubled from epoch 10 to epoch 1000
        expected.update({"preemption to next step, epoch 1000 over epoch 10": 2.0,
                         "grow to first full step, epoch 1000 over epoch 10": 2.0,
                         "SIGKILL to next step, epoch 1000 over epoch 10": 2.0})
    assert ratios == pytest.approx(expected)
    assert result["title"].endswith("at epoch " + " and ".join(map(str, epochs)))
