"""Golden equivalence, memory, saving and errors of `keras_dist.dtensor.shard`.

Each mesh runs in its own process (tests/dtensor/golden_main.py), every
check on that mesh one after another in it: DTensor must start before
TensorFlow, and (measured here) a process that trained on a 2-device mesh
hung on a 4-device one.
"""

import json
import math
import os
import pathlib
import sys

import keras
import numpy as np
import pytest
from helpers import run_concurrently

SCRIPT = os.path.join(os.path.dirname(__file__), "golden_main.py")


def rows_of(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


class Step:
    """One mode's part of a `golden_main.py steps` process's output."""

    def __init__(self, done, lines):
        self.returncode, self.stderr = done.returncode, done.stderr
        self.stdout = "\n".join(lines)


def steps_of(done) -> dict:
    """{mode: Step} from a `golden_main.py steps` process."""
    found, name = {}, None
    for line in done.stdout.splitlines():
        if line.startswith('{"step": '):
            name = json.loads(line)["step"]
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return {name: Step(done, lines) for name, lines in found.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every golden, one process per mesh, the three at once (outcomes are
    checked, not speed; two at a time ran model=4 only after model=2
    ended: 474 of the fixture's 489 s in one full run, where together the
    longest process, batch=2 x model=2, sets the time). model=2 trains
    the one-device references and writes them; the other meshes read them (the same seeded computation;
    the loss matrix's sharded models start from the weights model=2's
    one-device runs started from).
    Saved on batch=2 x model=2 (its first step), then loaded onto model=4
    (its last; it waits for the save)."""
    saved = str(tmp_path_factory.mktemp("saved"))
    errors = str(tmp_path_factory.mktemp("errors"))
    callbacks = str(tmp_path_factory.mktemp("callbacks"))
    references = str(tmp_path_factory.mktemp("references"))
    done = run_concurrently({
        # First: the processes that read the references wait for its rows.
        "model2": [sys.executable, SCRIPT, "steps", "model2", f"golden=write:{references}",
                   f"loss_matrix=write:{references}", "fully_sharded=2", "iterators"],
        "batch2_model2": [sys.executable, SCRIPT, "steps", "batch2_model2", f"save={saved}",
                          f"golden=read:{references}", "layout_map", "user_code",
                          "summed_validation",
                          f"loss_matrix=read:{references}", f"callbacks={callbacks}",
                          f"errors={errors}"],
        "model4": [sys.executable, SCRIPT, "steps", "model4", f"golden=read:{references}",
                   "fully_sharded=4", f"load={saved}", f"resume_copies={callbacks}"],
    }, jobs=3, timeout=1800)  # per process, for a stuck one: on CPUs 2x slower a sound run passed 600 s
    results = {}
    for mesh in ("model2", "batch2_model2", "model4"):
        rows_of(done[mesh])  # the process succeeded
        steps = steps_of(done[mesh])
        results[mesh] = steps.pop("golden")
        for name in ("loss_matrix", "fully_sharded"):  # run on more than one mesh
            if name in steps:
                results[f"{name}/{mesh}"] = steps.pop(name)
        results.update(steps)
    results["save_load"] = results.pop("load")
    return results, saved, errors


def float32_bound(optimizer: str) -> float:
    """How far float32 weights may end from one device's after a few steps.

    Adam divides each gradient by the root of its running square: on
    near-zero gradients it magnifies summation-order rounding, by an amount
    that depends on the CPU's kernels (the largest Adam distance measured:
    3.1e-6 on one CPU, 1.1e-5 and 2.2e-5 (FullySharded over 4) on a 2 GHz
    EPYC), while a missing or doubled reduction halves or doubles whole
    updates (learning rate x gradient, 1e-3 and more here). SGD and
    momentum pass rounding on as it is: 1e-5."""
    return 5e-5 if optimizer == "adam" else 1e-5


@pytest.mark.parametrize("mesh", ["model2", "model4", "batch2_model2"])
def test_sharded_training_matches_one_device_and_shards_memory(runs, mesh):
    rows = rows_of(runs[0][mesh])
    n = {"model2": 2, "model4": 4, "batch2_model2": 2}[mesh]
    assert [(r["model"], r["optimizer"], r["dtype"]) for r in rows] == [
        (model, optimizer, dtype)
        for model in ("mlp", "mlp_mixed", "transformer", "embedding", "conv", "einsum")
        for optimizer, dtype in (("sgd", "float32"), ("momentum", "float32"),
                                 ("adam", "float32"))
        + ((("adam", "float64"),) if model == "transformer" else ())
    ]
    for row in rows:
        # Something is sharded in every model: attention heads, the Dense and
        # EinsumDense pairs, the embedding table (never a convolution filter:
        # DTensor runs convolutions only with a replicated one).
        assert row["sharded"], row
        noise_floor = row.get("xla_vs_plain_one_device", 0.0)
        if row["dtype"] == "float64":
            assert row["max_diff"] < 1e-10, row
        elif row["model"] == "transformer" and row["optimizer"] == "adam":
            # float32 Adam amplifies summation-order rounding on near-zero
            # gradients (measured ~1e-4): bounded by what the same one-device
            # training differs by under XLA; the float64 row checks the math.
            assert row["max_diff"] <= 2 * noise_floor, row
        else:
            assert row["max_diff"] < float32_bound(row["optimizer"]), row
            assert row["predict_diff"] < 1e-5, row
        # Memory, from the shard each device holds: sharded variables 1/n.
        kind = row["model"]
        item = 8 if row["dtype"] == "float64" else 4
        if kind == "mlp":
            # up (8x32 + 32) and down (32x16) sharded; down bias and the
            # Dense(1) head (16 + 16 + 1) replicated.
            sharded, replicated = item * (8 * 32 + 32 + 32 * 16), item * 33
        elif kind == "mlp_mixed":  # the up bias replicated too
            sharded, replicated = item * (8 * 32 + 32 * 16), item * (32 + 33)
        elif kind == "embedding":
            sharded, replicated = item * 32 * 8, item * (32 + 1)
        elif kind == "conv":
            # fc1 (128x64 + 64) and the fc2 kernel (64x24) sharded; the
            # convolution (3x4x16 + 16), fc2 bias and the head (24x3 + 3)
            # replicated.
            sharded = item * (128 * 64 + 64 + 64 * 24)
            replicated = item * (3 * 4 * 16 + 16 + 24 + 24 * 3 + 3)
        elif kind == "einsum":
            # up (8x32 + 32) and the down kernel (32x16) sharded; the head
            # (16 + 1) replicated.
            sharded, replicated = item * (8 * 32 + 32 + 32 * 16), item * 17
        else:
            # attention q/k/v (3 x (16x4x8 + 4x8)) and output (4x8x16)
            # kernels, fc1 (16x32 + 32), fc2 kernel (32x16); replicated: the
            # attention output bias, LayerNorm, fc2 bias, the Dense(1) head.
            sharded = item * (3 * (16 * 32 + 32) + 32 * 16 + 16 * 32 + 32 + 32 * 16)
            replicated = item * (16 + 2 * 16 + 16 + 16 + 1)
        assert row["bytes_replicated_variables"] == sharded + replicated, row
        assert row["bytes_variables"] == sharded // n + replicated, row
        if row["optimizer"] == "adam":  # slots take their variable's layout
            assert row["bytes_optimizer"] == 2 * row["bytes_variables"] + (
                row["bytes_replicated_optimizer"] - 2 * row["bytes_replicated_variables"])


def test_saved_on_one_mesh_resumes_on_another(runs):
    # Epoch 1 on batch=2 x model=2 from a tf.data input, saved; epoch 2 on
    # model=4 after loading (weights and Adam state re-sharded) = 2 epochs on
    # one device.
    done, saved, _ = runs
    [row] = rows_of(done["save_load"])
    tmp_path = pathlib.Path(saved)
    assert row["saved_vs_one_device"] < 1e-5
    assert row["loaded_vs_saved"] == 0.0
    assert row["load_weights_vs_saved"] == 0.0
    assert row["second_epoch_vs_one_device"] < 1e-5, row
    assert row["sharded_on_load"]["variables"] < row["sharded_on_load"]["replicated_variables"]
    assert row["sharded_on_load"]["optimizer"] < row["sharded_on_load"]["replicated_optimizer"]
    assert row["evaluate"]["loss"] == pytest.approx(row["evaluate_keras"]["loss"], abs=1e-5)
    assert row["evaluate"]["accuracy"] == row["evaluate_keras"]["accuracy"]
    assert row["predict_dataset_diff"] < 1e-5
    assert row["predict_odd_diff"] < 1e-5
    assert row["evaluate_odd"]["loss"] == pytest.approx(
        row["evaluate_odd_keras"]["loss"], abs=1e-5)
    assert row["evaluate_odd"]["accuracy"] == row["evaluate_odd_keras"]["accuracy"]
    # The file is plain Keras: it loads unsharded anywhere.
    saved = np.load(tmp_path / "after_one_epoch.npz")
    plain = keras.saving.load_model(tmp_path / "model.keras")
    for i, weight in enumerate(plain.get_weights()):
        np.testing.assert_array_equal(weight, saved[f"arr_{i}"])
    assert plain.optimizer.iterations.numpy() == 4  # 64 samples, batch 16


def test_bad_arguments_are_named_before_any_step(runs):
    done, _, errors = runs
    [messages] = rows_of(done["errors"])
    tmp_path = errors
    expected = {
        "batch_size_not_divisible": "ValueError: fit(): argument `batch_size` must be "
        "divisible by the mesh axis 'batch' of size 2. Received: batch_size=15",
        "last_batch_not_divisible": "the last batch of 15 samples (63 training samples, "
        "batch_size=16) cannot be split",
        "y_missing": "argument `y` is required",
        "epochs_zero": "Received: epochs=0",
        "y_with_dataset": "argument `y` must be None when `x` is a tf.data.Dataset",
        "dataset_odd_batch": "dataset.batch(n, drop_remainder=True)",
        "save_suffix": "must be a path ending in '.keras'. Received: filepath=",
        "load_missing": "FileNotFoundError: Argument `filepath` names no file",
        "layout_map_type": "TypeError: Argument `layout_map` must be a",
        # 60 samples, 5% held out for validation as Keras splits them
        # (floor): 57 train, and batch 16 leaves a last batch of 9.
        "validation_split_last_batch": "the last batch of 9 samples (57 training samples",
        "callback_refused": "ValueError: Invalid callback in argument `callbacks`: "
        "PerReplicaMetrics measures the replicas of a tf.distribute strategy",
        "recurrent_loop": "ValueError: shard() cannot run layer 'lstm",
    }
    for name, text in expected.items():
        assert messages[name] is not None and text in messages[name], (name, messages[name])
    assert messages["weights_unchanged"] == 0.0
    assert not os.listdir(tmp_path)  # nothing written by the refused save


def test_shard_names_a_wrong_mesh():
    import keras_dist.dtensor as kd

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(TypeError, match=r"`mesh` must be a keras.distribution.DeviceMesh.*"
                                        r"Received: mesh=\{'model': 2\}"):
        kd.shard(model, {"model": 2})


def test_a_keras_layout_map_written_for_jax_is_used_unchanged(runs):
    # Regex keys and tuples, as for keras.distribution.ModelParallel; its
    # convolution kernel is sharded by output channel, which DTensor cannot
    # run: replicated, with a warning naming it. Trains to one device's
    # weights (Adam), with the Dense pair's bytes halved.
    [row] = rows_of(runs[0]["layout_map"])
    assert [w for w in row["warnings"] if "convolution" in w] == [
        f"Variable 'conv/conv/{name}' belongs to a convolution: replicated, not "
        f"laid out as {axes}. DTensor runs a convolution only with its filter and "
        "bias replicated. Map it to None in the layout map to silence this warning."
        for name, axes in (("bias", "('model',)"), ("kernel", "(None, None, 'model')"))
    ]
    assert row["max_diff"] < 1e-5, row
    # fc1 and the fc2 kernel sharded as mapped.
    sharded = 4 * (128 * 64 + 64 + 64 * 24)
    replicated = 4 * (3 * 4 * 16 + 16 + 24 + 24 * 3 + 3)
    assert row["bytes_replicated_variables"] == sharded + replicated
    assert row["bytes_variables"] == sharded // 2 + replicated


def test_a_sharded_model_is_a_keras_model_with_keras_callbacks(runs):
    # Keras' own fit loop drives the sharded steps: History, validation,
    # EarlyStopping restoring the best weights, ModelCheckpoint writing plain
    # .keras files, and Keras' BackupAndRestore resuming a SIGKILLed run.
    [row] = rows_of(runs[0]["callbacks"])
    [copies] = rows_of(runs[0]["resume_copies"])  # resumed by the model=4 process
    row.update(copies)
    row["ours_other_mesh"]["killed_returncode"] = row["ours"]["killed_returncode"]
    assert row["history_type"] == "History"
    assert row["epochs"][0] == row["epochs"][1] < 30, row  # stopped early, alike
    assert row["history_diff"] < 1e-5, row  # loss, val_loss per epoch
    assert row["early_stopping_diff"] < 1e-5, row
    assert row["checkpoint_files"] == ["epoch1.keras", "epoch2.keras"]
    assert row["checkpoint_diff"] == 0.0
    # A callback's setup_fit and step wrapper (the fit session), as on a
    # DistributedModel: 4 steps (32 samples, batch 8) in its fit, none after.
    assert row["session"] == {"mesh": {"batch": 2, "model": 2}, "calls": 4, "after": 4,
                              "torn_down": True}, row["session"]
    # steps_per_execution=3 with class weights = one device, one step a call.
    assert row["class_weight_logs_diff"] < 1e-5, row
    assert row["class_weight_diff"] < 1e-5, row
    assert row["killed_returncode"] == -9  # SIGKILL after epoch 2 of 4
    assert row["resumed_epochs"] == 2, row  # epochs 3 and 4 only
    assert row["resumed_diff"] < 1e-5, row  # = 4 uninterrupted epochs (Adam)
    # Killed on batch=2 x model=2, resumed on model=4 (the backup holds the
    # gathered weights and Adam state; the new mesh re-shards them).
    other = row["other_mesh"]
    assert isinstance(other, dict), other
    assert other["epochs"] == 2 and other["diff"] < 1e-5, other
    assert other["bytes"]["variables"] < other["bytes"]["replicated_variables"] / 2, other
    # keras_dist's LearningRateScaler scales by the mesh's "batch" axis (2):
    # 0.01 -> 0.02 over a 3-step warmup, = one device with that schedule,
    # and the unscaled rate back after fit.
    scaler = row["scaler"]
    assert scaler["factor"] == 2.0, scaler
    assert scaler["diff"] < 1e-5, scaler
    np.testing.assert_allclose(scaler["learning_rates"], [0.02, 0.02], rtol=1e-6)
    assert abs(scaler["after_fit"] - 0.01) < 1e-9, scaler
    # keras_dist's BackupAndRestore, a backup after every batch, on Keras'
    # default shuffle=True with no TensorFlow seed (keras_dist's own order,
    # a new one each epoch): SIGKILLed in the middle of epoch 2, resumed
    # there on the same mesh and on model=4: epochs 2-4 only, 32 optimizer
    # steps in all, the weights of 4 uninterrupted epochs on one device in
    # the killed run's order (SGD momentum).
    for key in ("ours", "ours_other_mesh"):
        resumed = row[key]
        assert isinstance(resumed, dict), resumed
        assert resumed["killed_returncode"] == -9, resumed
        assert resumed["epochs"] == 3 and resumed["iterations"] == 32, resumed
        assert resumed["diff"] < 1e-5, resumed
        # The fit session counts the passes and the backup holds the seed:
        # no warning about the input's order.
        assert resumed["order_warnings"] == [], resumed
    assert row["ours_other_mesh"]["bytes"]["variables"] < (
        row["ours_other_mesh"]["bytes"]["replicated_variables"] / 2)


MATRIX_CASES = ["all_heads", "class_weight", "class_weight_logits", "circle", "ctc"]


def check_loss_matrix(rows):
    """Every case of golden_main.matrix_cases: the keys Keras logs, each
    history value (every epoch), evaluate and the trained weights within
    1e-5 (relative to the number's size above 1) of one device from the
    same weights."""
    assert [r["case"] for r in rows] == MATRIX_CASES, rows
    for row in rows:
        assert row["keys"][0] == row["keys"][1], row
        assert row["evaluate_keys"][0] == row["evaluate_keys"][1], row
        assert "val_loss" in row["history_diff"], row
        bad = {k: v for k, v in {**row["history_diff"], **row["evaluate_diff"]}.items()
               if not v < 1e-5}
        assert not bad, (row["case"], bad)
        assert max(row["weights_diff"].values()) < 1e-5, (row["case"], row["weights_diff"])
    # Every built-in loss logs under its head in the one many-headed model.
    heads = {k[:-len("_loss")] for k in rows[0]["keys"][0]
             if k.endswith("_loss") and not k.startswith("val_")}
    assert len(heads) == 26, sorted(heads)


@pytest.mark.parametrize("mesh", ["model2", "batch2_model2"])
def test_every_builtin_loss_and_common_metric_logs_what_keras_logs(runs, mesh):
    # Sample weights (training and validation), class weights, validation
    # data, probabilities and logits, pairwise (circle) and sequence (CTC)
    # losses; the launched 2-process mesh runs the same cases
    # (test_one_mesh_spans_the_processes_of_a_launched_job).
    rows = rows_of(runs[0][f"loss_matrix/{mesh}"])
    check_loss_matrix(rows)
    if mesh == "batch2_model2":  # started from the weights model=2's references did
        assert all(r["read_initial_diff"] == 0 for r in rows), rows


def test_every_logged_number_is_the_one_keras_logs(runs):
    # The many-headed model's validation set is saturated (inputs x30,
    # targets reversed: confidently wrong), with heads whose probabilities
    # come from a softmax activation, a Softmax layer (in a nested model),
    # a sigmoid, and logits: every logged number (each head's loss and
    # metrics, each epoch) and evaluate equal one device's from the same
    # weights (test_every_builtin_loss_and_common_metric_logs_what_keras_logs
    # checks the differences). Computed from the gathered probabilities,
    # val_loss was 15.6 where Keras logs 167.5.
    for mesh in ("model2", "batch2_model2"):
        [row] = [r for r in rows_of(runs[0][f"loss_matrix/{mesh}"])
                 if r["case"] == "all_heads"]
        history = row["history"]
        for head in ("scce", "scce_logits", "cce", "cce_softmax_layer", "cce_logits"):
            # Saturated: beyond what clipped probabilities give (-log(1e-7) = 16.1).
            assert history[f"val_{head}_loss"][-1] > 16.2, (mesh, head, history)

def test_models_written_the_ordinary_ways_shard_and_match_one_device(runs):
    # Dict inputs and two outputs (each output's loss logged), a user's layer
    # next to a Lambda with a closure, BatchNormalization over the split
    # batch, an unrolled LSTM: built alike on one device, sharded on
    # batch=2 x model=2; fit with Keras' default shuffle after a seed, and a
    # validation split.
    rows = rows_of(runs[0]["user_code"])
    assert [r["model"] for r in rows] == [
        "dict_two_outputs", "custom_layer_and_lambda", "batch_norm", "lstm_unrolled"]
    for row in rows:
        assert row["sharded"], row  # a Dense pair in each
        assert row["max_diff"] < 1e-5, row
        assert row["log_keys"][0] == row["log_keys"][1], row
        assert row["evaluate_keys"][0] == row["evaluate_keys"][1], row
        assert row["logs_diff"] < 1e-5 and row["evaluate_diff"] < 1e-5, row
        assert row["predict_diff"] < 1e-5, row
    assert rows[0]["log_keys"][1] == ["cls_accuracy", "cls_loss", "loss", "reg_loss",
                                      "val_cls_accuracy", "val_cls_loss", "val_loss",
                                      "val_reg_loss"]


def test_validation_is_batched_as_keras_batches_it(runs):
    # A loss summed per batch logs another val_loss with another batching:
    # shuffled arrays (Keras' default, after a seed) and 40 validation rows
    # in fit's batches of 8 on batch=2 x model=2, every number one device's
    # (validated in batches of 32 they were 17.4 away).
    [row] = rows_of(runs[0]["summed_validation"])
    assert row["keys"][0] == row["keys"][1] == ["loss", "mae", "val_loss", "val_mae"], row
    assert max(row["diff"].values()) < 1e-5, row


def test_epoch_iterators_are_torn_down_off_the_training_thread_when_safe(runs):
    # A generator's iterators are torn down where Keras drops them; a tf.data
    # pipeline's and arrays' (2 epochs: each epoch's, and the spare one
    # Keras makes at the end of each) go to the release thread, and every
    # one is released.
    row = rows_of(runs[0]["iterators"])[0]
    got = [row[k]["released_in_background"] for k in ("generator", "tf.data", "arrays")]
    assert got[0] == 0 and got[1] >= 2 and got[2] >= 2, row
    for name in ("generator", "tf.data", "arrays"):
        assert len(row[name]["losses"]) == 2 and all(map(math.isfinite, row[name]["losses"]))
    assert row["all_released"] is True


@pytest.mark.parametrize("size", [2, 4])
def test_fully_sharded_splits_weights_and_slots_and_trains_as_one_device(runs, size):
    # FullySharded over {"batch": size}: every variable of 256 elements or
    # more split over the batch axis at its first dimension that divides
    # (the convolution's too: each step gathers before the forward pass),
    # the small ones replicated; momentum and Adam train to one device's
    # weights, log its numbers and predict as it does.
    rows = rows_of(runs[0][f"fully_sharded/{'model2' if size == 2 else 'model4'}"])
    *rows, dropout = rows
    assert [r["optimizer"] for r in rows] == ["momentum", "adam"]
    # Dropout: the seed generator's counter advanced by the 4 steps, as on
    # one device (a new mask each step, not the first one again; the seed
    # itself is the copy's own: masks differ from one device's, as documented).
    draws = [after[1] - before[1] for before, after in zip(dropout["before"], dropout["after"])]
    assert draws == [state[1] for state in dropout["one_device_after"]] == [4], dropout
    split = {"emb/embeddings": ["batch", "unsharded"],
             "conv/kernel": ["unsharded", "batch", "unsharded"],
             "fc/kernel": ["batch", "unsharded"],
             "head/kernel": ["batch", "unsharded"]}
    for row in rows:
        assert row["size"] == size
        layouts = row["layouts"]
        assert {p: a for p, a in layouts.items() if "batch" in a} == split, layouts
        assert row["max_diff"] < float32_bound(row["optimizer"]), row
        assert row["history_diff"] < 1e-5, row
        assert row["keys"][0] == row["keys"][1] == [
            "loss", "mae", "val_loss", "val_mae"], row
        assert row["predict_diff"] < 1e-5, row
        # Bytes read from the live shards: the split variables 1/size each,
        # the replicated 164 elements whole (biases, LayerNormalization).
        split_elements = 64 * 16 + 3 * 16 * 32 + 192 * 64 + 64 * 4
        data = row["bytes"]
        assert data["replicated_variables"] == 4 * (split_elements + 164), data
        assert data["variables"] == 4 * (split_elements // size + 164), data
        assert data["variables"] <= (1 / size + 0.1) * data["replicated_variables"], data
        assert data["optimizer"] <= (1 / size + 0.1) * data["replicated_optimizer"], data
