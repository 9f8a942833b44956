"""One DTensor mesh over the processes of a `keras-dist launch` job.

A module of its own: its job runs beside the other DTensor goldens'
processes (tests/dtensor/test_sharded_model.py), not after them.
"""

import json
import re
import sys  # noqa: F401

import numpy as np
import pytest

from dtensor.test_sharded_model import MATRIX_CASES, SCRIPT, check_loss_matrix


@pytest.mark.multi_worker
def test_one_mesh_spans_the_processes_of_a_launched_job(tmp_path, capfd):
    # keras-dist launch --num-workers 2, each process with 2 logical CPUs: one
    # batch=2 x model=2 mesh over the 4 (multi-client DTensor, set up from the
    # launcher's TF_CONFIG). No seed: each process builds other initial
    # weights; the sharded model starts from process 0's on both.
    import keras_dist

    # The job runs minutes; the processes join their mesh in its first
    # seconds. A launcher that did not see them join stopped the job at
    # `start_timeout` as "never joined" (exit 124), and warned at the end
    # that the workers "never formed a multi-worker cluster".
    status = keras_dist.launch(SCRIPT, ["multiclient", "batch2_model2", str(tmp_path)],
                               num_workers=2, start_timeout=120)
    captured = capfd.readouterr()
    out = captured.out
    # The launcher's own report (which worker, why) is on stderr.
    assert status == 0, captured.out[-3000:] + captured.err[-3000:]
    assert "never formed" not in captured.err and "never joined" not in captured.err
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    assert [int(r["clients"]) for r in ranks] == [2, 2]
    # Against one device started from the same weights (weights, and every
    # epoch's loss and validation loss): momentum in float32, Adam in
    # float64. float32 Adam amplifies summation-order noise (a near-zero
    # gradient entry's sign), as much for one device compiled by XLA: it is
    # held to identical weights on both processes only.
    tolerance = {"momentum": 1e-5, "adam64": 1e-10}
    for name in ("momentum", "adam", "adam64"):
        assert np.abs(ranks[0][f"{name}_local_initial"]
                      - ranks[1][f"{name}_local_initial"]).max() > 1e-3
        np.testing.assert_array_equal(ranks[0][f"{name}_initial"], ranks[1][f"{name}_initial"])
        for r in ranks:
            if name in tolerance:
                assert float(r[f"{name}_max_diff"]) < tolerance[name], name
                assert float(r[f"{name}_logs_diff"]) < tolerance[name], name
            # The Dense pair halved on each device; the rest replicated.
            size = 8 if name == "adam64" else 4
            sharded = size * (128 * 64 + 64 + 64 * 24)
            replicated = size * (3 * 4 * 16 + 16 + 24 + 24 * 3 + 3)
            assert r[f"{name}_bytes"].tolist() == [sharded // 2 + replicated,
                                                   sharded + replicated]
        weights = [k for k in ranks[0].files if k.startswith(f"{name}_w")]
        assert len(weights) == 8, weights
        for key in weights:
            np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    # A tf.data pipeline shuffled with one seed on both processes, then
    # evaluate and predict with a short last batch.
    for r in ranks:
        assert float(r["dataset_max_diff"]) < 1e-5
        assert float(r["evaluate_diff"]) < 1e-5 and float(r["predict_diff"]) < 1e-5
    np.testing.assert_array_equal(ranks[0]["predictions"], ranks[1]["predictions"])
    # Keras' default shuffle=True on arrays, unseeded: both processes fed
    # the order process 0 drew (identical weights and logs), which is one
    # device's run in that order (weights and every epoch's loss and
    # val_loss within 1e-5) and not the unshuffled run.
    shuffled = [k for k in ranks[0].files if re.fullmatch(r"shuffled_w\d+", k)]
    assert len(shuffled) == 8, shuffled
    for key in [*shuffled, "shuffled_history"]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert float(ranks[0]["shuffled_shuffled_max_diff"]) < 1e-5
    np.testing.assert_allclose(ranks[0]["shuffled_history"],
                               ranks[0]["shuffled_shuffled_history"], rtol=1e-5)
    assert float(ranks[0]["shuffled_unshuffled_max_diff"]) > 1e-3
    # keras_dist's BackupAndRestore on the 2-process mesh: a crash at batch
    # 6 of epoch 2 on both, a new model resumed from process 0's backup
    # mid-epoch: one device's uninterrupted weights, epochs 2 and 3 logged
    # as it logs them, the same weights on both, the backups gone after.
    for r in ranks:
        assert bool(r["kd_backup_crashed"]) and r["kd_backup_epochs"].tolist() == [1, 2]
        assert float(r["kd_backup_max_diff"]) < 1e-5
        # Unshuffled arrays: the resume is exact and says nothing about order.
        assert r["kd_backup_order_warnings"].tolist() == []
        np.testing.assert_allclose(r["kd_backup_loss"], r["kd_backup_expected_loss"][1:],
                                   rtol=1e-5)
    # Process 0 deletes them as its fit ends (process 1's fit may end first).
    assert ranks[0]["kd_backup_left"].tolist() == []
    restored = [k for k in ranks[0].files if re.fullmatch(r"kd_backup_w\d+", k)]
    assert len(restored) == 8, restored
    for key in restored:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert "BackupAndRestore: restored" in out and "(epoch 2, step " in out
    # Keras' file-writing callbacks, progress output and saving, called on
    # both processes as a user's script does: the job leaves what one
    # process leaves (as a multi-worker DistributedModel's does).
    files = tmp_path / "files"
    for r in ranks:
        # Interrupted after epoch 2, resumed from process 0's Keras backup
        # by both: epoch 3 alone, logged as one device logs it, the weights
        # of 3 uninterrupted epochs on one device.
        assert bool(r["files_interrupted"]) and r["files_resumed_epochs"].tolist() == [2]
        np.testing.assert_allclose(r["files_resumed_loss"], r["files_expected_loss"][2:],
                                   rtol=1e-5)
        np.testing.assert_allclose(r["files_resumed_val_loss"],
                                   r["files_expected_val_loss"][2:], rtol=1e-5)
        assert float(r["files_max_diff"]) < 1e-5
        # final.keras and final.weights.h5, read at once on both processes.
        assert float(r["files_loaded_diff"]) == 0.0
    rows = (files / "log.csv").read_text().splitlines()
    assert rows[0] == "epoch,loss,val_loss", rows
    assert [row.split(",")[0] for row in rows[1:]] == ["0", "1", "2"], rows
    logged = np.array([[float(v) for v in row.split(",")[1:]] for row in rows[1:]])
    np.testing.assert_allclose(logged[:, 0], ranks[0]["files_expected_loss"], rtol=1e-5)
    np.testing.assert_allclose(logged[:, 1], ranks[0]["files_expected_val_loss"], rtol=1e-5)
    for run in ("train", "validation"):  # one event file per fit, one process's
        assert len(list((files / "tb" / run).glob("events.out.tfevents.*"))) == 2, run
    assert not (files / "backup").exists()  # Keras deletes it when training ends
    assert {p.name for p in files.iterdir()} == {
        "log.csv", "tb", "checkpoint.keras", "final.keras", "final.weights.h5"}
    import keras

    # ModelCheckpoint saved after the last epoch: the weights saved after fit.
    checkpoint = keras.saving.load_model(files / "checkpoint.keras").get_weights()
    final = keras.saving.load_model(files / "final.keras").get_weights()
    assert len(checkpoint) == len(final) == 8
    for a, b in zip(checkpoint, final):
        np.testing.assert_array_equal(a, b)
    progress = [line for line in out.splitlines() if re.search(r"Epoch \d/3$", line)]
    assert progress and all(line.startswith("[worker 0] ") for line in progress), progress
    # The loss and metric matrix on the 2-process mesh: each worker's rows.
    printed = {0: [], 1: []}
    for line in out.splitlines():
        match = re.match(r"\[worker (\d)\] (\{.*\})$", line)
        if match:
            printed[int(match.group(1))].append(json.loads(match.group(2)))
    check_loss_matrix(printed[0])  # process 0 against one device
    # Process 1 logged the same numbers and holds the same weights.
    assert [r["case"] for r in printed[1]] == MATRIX_CASES
    for mine, theirs in zip(printed[0], printed[1], strict=True):
        for key in ("history", "evaluated", "weights_digest"):
            assert mine[key] == theirs[key], (mine["case"], key)
