import json
from unittest import mock

import pytest
import tensorflow as tf

import keras_dist
from keras_dist import strategy as strategy_lib

from helpers import two_replicas


def test_auto_uses_the_simulated_replicas():
    strategy = keras_dist.resolve_strategy("auto")
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 4


def test_same_request_returns_same_object():
    assert keras_dist.resolve_strategy("mirrored") is keras_dist.resolve_strategy(
        "auto"
    )
    assert keras_dist.resolve_strategy("default") is tf.distribute.get_strategy()


def test_ready_strategy_is_returned_as_is():
    s = two_replicas()
    assert keras_dist.resolve_strategy(s) is s


def test_auto_prefers_the_open_scope():
    s = two_replicas()
    with s.scope():
        assert keras_dist.resolve_strategy("auto") is s
        assert keras_dist.resolve_strategy("default") is not s


def test_mirrored_strategies_of_different_sizes_coexist():
    # TF alone aborts the collective here (both start at group key 1).
    four = keras_dist.resolve_strategy("mirrored")
    two = two_replicas()
    for s, n in ((two, 2), (four, 4), (two, 2)):

        @tf.function
        def count():
            return s.run(  # noqa: B023 (called in this iteration)
                lambda: tf.distribute.get_replica_context().all_reduce(
                    "SUM", tf.constant(1.0)
                )
            )

        assert [float(v) for v in s.experimental_local_results(count())] == [n] * n


@pytest.mark.parametrize("spec", ["mirored", "", "MIRRORED"])
def test_unknown_spec(spec):
    with pytest.raises(ValueError, match=r"argument `strategy`.*Received: strategy="):
        keras_dist.resolve_strategy(spec)


def test_spec_of_wrong_type():
    with pytest.raises(TypeError, match=r"Received: strategy=3 of type int"):
        keras_dist.resolve_strategy(3)


@pytest.mark.parametrize(
    "raw, field",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "`cluster`"),
        (json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}}), "`task`"),
        (
            json.dumps(
                {
                    "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                    "task": {"type": "worker", "index": 2},
                }
            ),
            "`task.index`",
        ),
        (
            json.dumps(
                {
                    "cluster": {"worker": ["127.0.0.1:1"]},
                    "task": {"type": "chief", "index": 0},
                }
            ),
            "`task.type`",
        ),
        (
            json.dumps(
                {"cluster": {"worker": "127.0.0.1:1"}, "task": {"type": "worker"}}
            ),
            "`cluster.worker`",
        ),
        (
            json.dumps(
                {
                    "cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5000"]},
                    "task": {"type": "worker", "index": 0},
                }
            ),
            "'127.0.0.1:5000' appears twice",
        ),
    ],
)
@pytest.mark.parametrize("spec", ["auto", "multi_worker"])
def test_malformed_tf_config_fails_before_any_collective(raw, field, spec):
    with mock.patch.dict("os.environ", {"TF_CONFIG": raw}):
        with pytest.raises(ValueError, match="TF_CONFIG") as info:
            keras_dist.resolve_strategy(spec)
    assert field in str(info.value)
    assert "Received" in str(info.value)


def test_single_task_tf_config_is_not_multi_worker():
    raw = json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker"}}
    )
    with mock.patch.dict("os.environ", {"TF_CONFIG": raw}):
        assert keras_dist.resolve_strategy("auto").num_replicas_in_sync == 4


@pytest.mark.parametrize("value, error", [(0, ValueError), (-2, ValueError),
                                          (1025, ValueError), (100000, ValueError),
                                          ("2", TypeError), (2.0, TypeError),
                                          (True, TypeError)])
def test_simulate_replicas_rejects_bad_counts(value, error):
    # At once, before TensorFlow is asked for anything (100000 took minutes).
    with pytest.raises(error, match=f"Received: num_replicas={value!r}"):
        keras_dist.simulate_replicas(value)


def test_simulate_replicas_after_initialization():
    tf.constant(1.0)  # TensorFlow is initialized from here on.
    assert keras_dist.simulate_replicas(4) == 4  # same count: harmless
    with pytest.raises(RuntimeError, match=r"simulate_replicas\(3\).*top of your"):
        keras_dist.simulate_replicas(3)


def test_describe():
    assert keras_dist.describe("mirrored") == (
        "MirroredStrategy: 4 replicas, 1 worker (rank 0, chief), "
        "devices CPU:0, CPU:1, CPU:2, CPU:3"
    )
    assert keras_dist.describe("default").startswith(
        "DefaultStrategy: 1 replica, 1 worker (rank 0, chief)"
    )
    assert keras_dist.describe(two_replicas()).startswith("MirroredStrategy: 2")


def test_worker_info_outside_multi_worker():
    info = strategy_lib.worker_info(keras_dist.resolve_strategy("mirrored"))
    assert (info.num_workers, info.rank, info.is_chief) == (1, 0, True)


def test_auto_picks_multi_worker_from_tf_config():
    raw = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": 1},
        }
    )
    sentinel = object()
    with mock.patch.dict("os.environ", {"TF_CONFIG": raw}), mock.patch.object(
        strategy_lib, "_multi_worker", return_value=sentinel
    ):
        assert keras_dist.resolve_strategy("auto") is sentinel


def test_auto_picks_multi_worker_from_slurm():
    sentinel = object()
    env = {"SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2", "TF_CONFIG": ""}
    with mock.patch.dict("os.environ", env), mock.patch.object(
        strategy_lib, "_multi_worker", return_value=sentinel
    ):
        assert keras_dist.resolve_strategy("auto") is sentinel


def test_auto_tries_tpu_when_hinted_and_falls_back():
    with mock.patch.dict("os.environ", {"TPU_NAME": "no-such-tpu"}), mock.patch.object(
        strategy_lib, "_tpu", return_value=None
    ) as tpu:
        assert keras_dist.resolve_strategy("auto").num_replicas_in_sync == 4
    tpu.assert_called_once_with(required=False)


def test_explicit_tpu_without_a_tpu_says_how_to_fix():
    with mock.patch.object(
        tf.distribute.cluster_resolver,
        "TPUClusterResolver",
        side_effect=ValueError("Please provide a TPU Name"),
    ):
        with pytest.raises(RuntimeError, match='strategy="tpu".*TPU_NAME'):
            keras_dist.resolve_strategy("tpu")


def test_communication_options_are_checked_before_anything_starts():
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        bytes_per_pack=1 << 20,
    )
    # Accepted (single-process strategies ignore them).
    assert keras_dist.resolve_strategy("default", communication=options) is (
        keras_dist.resolve_strategy("default")
    )
    assert keras_dist.resolve_strategy("mirrored", communication="ring") is (
        keras_dist.resolve_strategy("mirrored")
    )
    with pytest.raises(ValueError, match=r"Received: communication='grpc'"):
        keras_dist.resolve_strategy("auto", communication="grpc")
    with pytest.raises(TypeError, match=r"Received: communication=4\."):
        keras_dist.resolve_strategy("auto", communication=4)
    with pytest.raises(ValueError, match=r"sees none\. Received: communication='nccl'"):
        keras_dist.resolve_strategy("auto", communication="nccl")
