"""Snapshot of the public API: every change to it shows up in review."""

import inspect

import keras_dist


def signature(obj) -> str:
    return str(inspect.signature(obj))


def test_top_level_names():
    assert keras_dist.__all__ == [
        "DistributedModel",
        "SidecarEvaluator",
        "average_loss",
        "describe",
        "distribute",
        "launch",
        "launch_search",
        "resolve_strategy",
        "scale_learning_rate",
        "simulate_replicas",
        "worker_info",
    ]
    assert keras_dist.__all__ == sorted(keras_dist.__all__)


def test_signatures():
    assert signature(keras_dist.resolve_strategy) == (
        "(spec: 'StrategySpec' = 'auto', *, communication: 'CommunicationSpec' = None) "
        "-> 'tf.distribute.Strategy'"
    )
    assert signature(keras_dist.simulate_replicas) == "(num_replicas: 'int') -> 'int'"
    assert signature(keras_dist.worker_info) == (
        "(strategy: 'StrategySpec | None' = None) -> 'WorkerInfo'"
    )
    assert signature(keras_dist.average_loss) == (
        "(per_example_loss, sample_weight=None, *, model: 'keras.Model | None' = None)"
    )
    assert signature(keras_dist.SidecarEvaluator) == (
        "(model, data, checkpoint_dir: 'str | os.PathLike', steps: 'int | None' = None, "
        "max_evaluations: 'int | None' = None, callbacks=None, *, "
        "poll_interval: 'float' = 1.0, timeout: 'float | None' = None, verbose: 'int' = 0)"
    )
    assert signature(keras_dist.describe) == "(strategy: 'StrategySpec | None' = None) -> 'str'"
    assert signature(keras_dist.distribute) == (
        "(model: 'keras.Model', strategy: 'StrategySpec' = 'auto', *, "
        "sync_batch_norm: 'bool' = True) -> 'DistributedModel'"
    )
    assert signature(keras_dist.launch) == (
        "(script: 'str', script_args: 'Sequence[str]' = (), *, "
        "num_workers: 'int | None' = None, hosts: 'str | None' = None, "
        "rank: 'int | None' = None, max_restarts: 'int' = 0, "
        "log_dir: 'str | None' = None, grace_period: 'float' = 5.0, "
        "module: 'bool' = False, port: 'int | None' = None, "
        "verbose: 'bool' = False, start_timeout: 'float | None' = 300.0, "
        "hang_timeout: 'float | None' = 900.0, private_network: 'bool | None' = None, "
        "min_workers: 'int | None' = None, rejoin_after: 'float' = 60.0, "
        "rendezvous: 'str | None' = None, gpus_per_worker: 'int | None' = None, "
        "kubernetes: 'bool' = False) -> 'int'"
    )
    assert signature(keras_dist.launch_search) == (
        "(script: 'str', script_args: 'Sequence[str]' = (), *, "
        "num_workers: 'int', workers_per_trial: 'int' = 1, "
        "port: 'int | None' = None, log_dir: 'str | None' = None, "
        "grace_period: 'float' = 5.0, finish_timeout: 'float' = 300.0, "
        "module: 'bool' = False, verbose: 'bool' = False, "
        "start_timeout: 'float | None' = 300.0, "
        "hang_timeout: 'float | None' = 900.0, private_network: 'bool | None' = None, "
        "gpus_per_worker: 'int | None' = None) -> 'int'"
    )
    assert signature(keras_dist.DistributedModel.__init__) == (
        "(self, *args, strategy: 'StrategySpec' = 'auto', "
        "sync_batch_norm: 'bool' = True, **kwargs)"
    )


def test_keras_drop_in_parity():
    """fit/evaluate/predict/compile keep Keras' arguments, in order."""
    import keras

    for name in ("fit", "evaluate", "predict", "compile", "save", "save_weights"):
        ours = inspect.signature(getattr(keras_dist.DistributedModel, name))
        theirs = inspect.signature(getattr(keras.Model, name))
        theirs_names = [
            p for p, v in theirs.parameters.items() if v.kind != v.VAR_KEYWORD
        ]
        ours_names = [p for p in ours.parameters][: len(theirs_names)]
        assert ours_names == theirs_names, name
        for p in theirs_names:
            assert ours.parameters[p].default == theirs.parameters[p].default, (name, p)
        extra = [
            p for p, v in ours.parameters.items()
            if p not in theirs.parameters and v.kind != v.VAR_KEYWORD
        ]
        assert all(ours.parameters[p].kind == inspect.Parameter.KEYWORD_ONLY
                   for p in extra), (name, extra)


def test_exports_resolve():
    assert sorted(keras_dist._EXPORTS) == keras_dist.__all__
    for name in keras_dist.__all__:
        assert getattr(keras_dist, name).__name__ == name


def test_callbacks_names_and_parity():
    import keras

    from keras_dist import callbacks

    assert callbacks.__all__ == sorted(callbacks.__all__) == [
        "BackupAndRestore",
        "LearningRateScaler",
        "PerReplicaMetrics",
        "RayReport",
        "ResourceMonitor",
    ]
    assert str(inspect.signature(callbacks.RayReport.__init__)) == (
        "(self, metrics: 'Sequence[str] | Mapping[str, str] | None' = None, "
        "checkpoint: 'bool' = True)"
    )
    assert str(inspect.signature(callbacks.ResourceMonitor.__init__)) == (
        "(self, update_freq: \"Literal['epoch'] | int\" = 'epoch', *, verbose: 'int' = 0)"
    )
    ours = inspect.signature(callbacks.BackupAndRestore.__init__)
    assert str(ours) == (
        "(self, backup_dir: 'str | os.PathLike', "
        "save_freq: \"Literal['epoch'] | int\" = 'epoch', "
        "double_checkpoint: 'bool' = False, delete_checkpoint: 'bool' = True, *, "
        "max_to_keep: 'int' = 2, save_every_seconds: 'float | None' = None, "
        "preemption_signals: 'int | Sequence[int] | None' = (<Signals.SIGTERM: 15>,), "
        "adopt_other_runs: 'bool' = False)"
    )
    theirs = inspect.signature(keras.callbacks.BackupAndRestore.__init__)
    positional = [p for p in ours.parameters.values()
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == [
        (p.name, p.default) for p in theirs.parameters.values()
    ]


def test_tuner_names_and_parity():
    import keras_tuner

    from keras_dist import tuner

    assert tuner.__all__ == sorted(tuner.__all__) == [
        "BayesianOptimization",
        "DistributedTuner",
        "GridSearch",
        "Hyperband",
        "RandomSearch",
        "is_chief",
    ]
    assert signature(tuner.DistributedTuner.__init__) == (
        "(self, *args, strategy: 'StrategySpec' = 'auto', "
        "connect_timeout: 'float' = 120.0, call_timeout: 'float' = 600.0, "
        "heartbeat_interval: 'float' = 5.0, worker_timeout: 'float' = 60.0, "
        "**kwargs)"
    )
    for name in ("BayesianOptimization", "GridSearch", "Hyperband", "RandomSearch"):
        ours = getattr(tuner, name)
        assert issubclass(ours, getattr(keras_tuner, name))
        assert ours.__mro__[1] is tuner.DistributedTuner


def test_dtensor_names():
    from keras_dist import dtensor

    assert dtensor.__all__ == sorted(dtensor.__all__) == [
        "FullySharded", "LayoutMapper", "ShardedModel", "initialize", "load_model",
        "make_mesh", "shard",
    ]
    assert signature(dtensor.FullySharded.__init__) == (
        "(self, min_elements: 'int' = 1024, axis: 'str' = 'batch')")
    assert signature(dtensor.LayoutMapper.__init__) == (
        "(self, mesh: 'keras.distribution.DeviceMesh', *, model_axis: 'str' = "
        "'model', embedding: \"Literal['vocabulary', 'dim']\" = 'vocabulary', "
        "min_elements: 'int' = 1024, rules: 'Mapping[str, Axes | None] | None' "
        "= None)"
    )
