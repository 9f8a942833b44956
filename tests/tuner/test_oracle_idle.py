"""A tuner told to wait is answered when a trial ends, not at once.

keras-tuner's worker asks the oracle again as soon as it is told to wait
(an IDLE trial); answered at once, the two processes traded calls as fast
as they could while the last trials trained beside them.
"""

import threading

import keras
import keras_tuner
import pytest

from keras_dist.tuner import RandomSearch, _oracle

Status = keras_tuner.engine.trial.TrialStatus


def build_model(hp):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(hp.Choice("units", [1, 2]))])
    model.compile("sgd", "mse")
    return model


def request(name, **fields):
    return getattr(keras_tuner.src.protos.get_service(), name)(**fields)


@pytest.mark.fast
def test_an_idle_answer_is_held_until_a_trial_ends(tmp_path, monkeypatch):
    tuner = RandomSearch(build_model, objective="loss", max_trials=2, max_retries_per_trial=1,
                         directory=tmp_path, project_name="p")
    servicer = _oracle._Servicer(tuner.oracle)
    first, second = (servicer.CreateTrial(request("CreateTrialRequest", tuner_id=t), None).trial
                     for t in ("a", "b"))
    ended = keras_tuner.engine.trial.Trial.from_proto(first)
    tuner.oracle.update_trial(ended.trial_id, {"loss": 1.0})
    ended.status = Status.COMPLETED
    servicer.EndTrial(request("EndTrialRequest", trial=ended.to_proto()), None)
    # "a" asks for more while "b" runs the last trial (it may be retried):
    # the answer waits for b's trial to end (here without a time limit).
    monkeypatch.setattr(_oracle, "IDLE_WAIT", None)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(servicer.CreateTrial(
        request("CreateTrialRequest", tuner_id="a"), None).trial))
    asking.start()
    asking.join(0.5)
    assert asking.is_alive() and not answers  # held, not answered IDLE at once
    last = keras_tuner.engine.trial.Trial.from_proto(second)
    tuner.oracle.update_trial(last.trial_id, {"loss": 2.0})
    last.status = Status.COMPLETED
    servicer.EndTrial(request("EndTrialRequest", trial=last.to_proto()), None)
    asking.join(30)
    assert not asking.is_alive()
    assert Status.from_proto(answers[0].status) == Status.STOPPED  # the search is over
