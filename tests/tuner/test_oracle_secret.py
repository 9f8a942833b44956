"""The search's secret: the chief's oracle answers only its own processes.

The chief of a keras_dist tuner serves the oracle in a thread of this
process, as `keras-dist tune` starts it (a port on 127.0.0.1, the secret in
`KERAS_DIST_ORACLE_SECRET`); an intruder on the same machine calls it with
keras-tuner's own client and with a wrong secret, then a worker with the
secret runs the one trial through.
"""

import socket
import threading

import grpc
import keras
import keras_tuner
import numpy as np
import pytest

from keras_dist.tuner import RandomSearch, _oracle


def build_model(hp):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(hp.Choice("units", [1]))])
    model.compile("sgd", "mse")
    return model


@pytest.fixture
def chief(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(_oracle, "_secret", None)
    for name, value in {"KERASTUNER_TUNER_ID": "chief", "KERASTUNER_ORACLE_IP": "127.0.0.1",
                        "KERASTUNER_ORACLE_PORT": str(port),
                        _oracle.SECRET_ENV: "the-search-secret"}.items():
        monkeypatch.setenv(name, value)
    tuner = RandomSearch(build_model, objective="loss", max_trials=1,
                         directory=tmp_path, project_name="p")
    x = np.zeros((4, 3), "float32")
    serving = threading.Thread(target=tuner.search, args=(x, x[:, :1]), daemon=True)
    serving.start()
    yield tuner, serving
    serving.join(timeout=5)


def refused(call) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, error.value
    return error.value.details()


def test_a_client_without_the_search_secret_is_refused(chief, capsys):
    tuner, serving = chief
    # keras-tuner's own client (what another local process would run): no secret.
    intruder = keras_tuner.src.distribute.oracle_client.OracleClient(None)
    details = refused(intruder.get_space)
    assert details == (
        "keras_dist.tuner: this oracle answers only the processes of its own "
        "search, which carry its secret (KERAS_DIST_ORACLE_SECRET, set by "
        "keras-dist tune).")
    refused(lambda: intruder.create_trial("intruder"))
    refused(lambda: intruder.update_trial("00", {"loss": 0.0}))
    wrong = grpc.intercept_channel(grpc.insecure_channel(_oracle.oracle_address()),
                                   _oracle._WithSecret("a-guess"))
    stub = keras_tuner.src.protos.get_service_grpc().OracleStub(wrong)
    request = keras_tuner.src.protos.get_service().CreateTrialRequest(tuner_id="intruder")
    refused(lambda: stub.CreateTrial(request, timeout=30))
    assert not tuner.oracle.trials  # nothing was handed out or reported

    # A worker of the search: the same calls answered, its score recorded.
    worker = _oracle.Client(None, connect_timeout=30, call_timeout=30, heartbeat_interval=60)
    assert worker.get_space().get("units") == 1
    trial = worker.create_trial("tuner0")
    assert trial.status == "RUNNING"
    worker.update_trial(trial.trial_id, {"loss": 0.25})
    trial.status = "COMPLETED"
    worker.end_trial(trial)
    assert worker.create_trial("tuner0").status == "STOPPED"
    serving.join(timeout=60)
    assert not serving.is_alive()
    assert [t.score for t in tuner.oracle.trials.values()] == [0.25]
    out = capsys.readouterr().out
    # Said once per connection (gRPC may share one between channels), not per call.
    assert 1 <= out.count("refused a call from") <= 2, out
