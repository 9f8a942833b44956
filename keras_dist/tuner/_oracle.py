"""The chief's oracle service and the workers' client, on keras-tuner's gRPC.

Both sides speak keras-tuner's own `Oracle` gRPC service unchanged (its
messages, its servicer, its client). What is added around them:

- chief: the server runs until the search is over, checked every fraction
  of a second (keras-tuner's loop sleeps 20 s at a time); every call from a
  tuner worker counts as a sign of life, and a worker silent for longer than
  `worker_timeout` has its running trial ended as `INVALID` (keras-tuner then
  retries it, up to `max_retries_per_trial`, or marks it `FAILED`) and is
  forgotten, so a dead worker never keeps the chief waiting;
- chief: a tuner told to wait (an `IDLE` trial: keras-tuner's Hyperband
  between brackets, or the last trials of a search that may be retried) is
  answered once a trial ends or after `IDLE_WAIT` s, not at once:
  keras-tuner's worker asks again without pausing, and the round trips
  took the CPU from the trials still running;
- worker: the first contact waits at most `connect_timeout` for the chief,
  every call has a deadline of `call_timeout` (keras-tuner's is one hour),
  and while a trial runs a background thread calls `GetTrial` every
  `heartbeat_interval` seconds;
- both: a search's secret. `keras-dist tune` draws one per search and hands
  it to its own processes (`SECRET_ENV`); every call carries it, and the
  chief answers no call without it (`UNAUTHENTICATED`), so another local
  process cannot read the search space, take trials or report scores. With
  no secret set (a chief started by hand) the oracle is open, as
  keras-tuner's is.
"""

from __future__ import annotations

import collections
import hmac
import os
import threading
import time
from concurrent import futures

import grpc

from keras_dist.tuner import _kt_compat as kt
from keras_dist.tuner._kt_compat import OracleServicer, synchronized

SECRET_ENV = "KERAS_DIST_ORACLE_SECRET"
_WAIT_NOTICE_AFTER = 10.0  # a longer wait for the chief is said once
IDLE_WAIT = 0.5  # longest hold of an IDLE answer (a trial's end answers sooner)
_SERVER_THREADS = 32  # calls served at once: held IDLE answers among them
_METADATA_KEY = "keras-dist-oracle-secret"
_secret: str | None = None  # taken out of the environment by `take_secret`


def take_secret() -> None:
    """Moves the search's secret from the environment into this process, so
    that what the user's script starts does not inherit it."""
    global _secret
    _secret = os.environ.pop(SECRET_ENV, None) or _secret


def secret() -> str | None:
    return _secret or os.environ.get(SECRET_ENV) or None


class _RequireSecret(grpc.ServerInterceptor):
    """Answers no call that does not carry the search's secret."""

    def __init__(self, expected: str):
        self._expected = expected.encode()
        self._refused_peers: set[str] = set()

        def refuse(request, context):
            peer = context.peer()
            if peer not in self._refused_peers:
                self._refused_peers.add(peer)
                _say(f"refused a call from {peer}: it did not carry this "
                     "search's secret (only keras-dist tune's own processes "
                     "have it)")
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "keras_dist.tuner: this oracle answers only the processes of "
                f"its own search, which carry its secret ({SECRET_ENV}, set by "
                "keras-dist tune).",
            )

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get(_METADATA_KEY, "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return continuation(details)
        return self._refuse


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _WithSecret(grpc.UnaryUnaryClientInterceptor):
    """Adds the search's secret to every call."""

    def __init__(self, value: str):
        self.value = value

    def intercept_unary_unary(self, continuation, details, request):
        metadata = list(details.metadata or ()) + [(_METADATA_KEY, self.value)]
        return continuation(_CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready, details.compression), request)


def channel(address: str):
    """A channel to the oracle whose calls carry this search's secret."""
    plain = grpc.insecure_channel(address)
    value = secret()
    return grpc.intercept_channel(plain, _WithSecret(value)) if value else plain


def oracle_address() -> str:
    return (
        f"{os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
    )


class _Servicer(OracleServicer):
    """keras-tuner's servicer, noting when each tuner id was last heard of."""

    def __init__(self, oracle):
        super().__init__(oracle)
        self.lock = threading.Lock()
        now = time.monotonic()
        # Tuner ids known from a reloaded state start their clock now.
        self.last_seen = {tuner_id: now for tuner_id in oracle.tuner_ids}
        self.last_seen.update({t: now for t in oracle.ongoing_trials})
        self.trial_ended = threading.Condition()

    def _seen(self, tuner_id=None, trial_id=None) -> None:
        now = time.monotonic()
        with self.lock:
            if tuner_id is not None:
                self.last_seen[tuner_id] = now
            if trial_id is not None:
                for tid, trial in list(self.oracle.ongoing_trials.items()):
                    if trial.trial_id == trial_id:
                        self.last_seen[tid] = now

    def silent(self, timeout: float) -> list[str]:
        """Tuner ids that hold a trial or a place, silent for `timeout` s."""
        now = time.monotonic()
        known = _known_tuners(self.oracle)
        with self.lock:
            for tuner_id in known:
                self.last_seen.setdefault(tuner_id, now)
            return sorted(
                t for t in known if now - self.last_seen[t] > timeout
            )

    def CreateTrial(self, request, context):
        self._seen(tuner_id=request.tuner_id)
        if _should_wait(self.oracle, request.tuner_id):
            self._hold()
            if _should_wait(self.oracle, request.tuner_id):
                trial = kt.Trial(
                    self.oracle.hyperparameters.copy(),
                    status=kt.TrialStatus.IDLE,
                )
                return kt.protos.get_service().CreateTrialResponse(trial=trial.to_proto())
        response = super().CreateTrial(request, context)
        if kt.TrialStatus.from_proto(response.trial.status) == kt.TrialStatus.IDLE:
            self._hold()  # the oracle's own IDLE (Hyperband between brackets)
        return response

    def _hold(self) -> None:
        """Until a trial ends, at most `IDLE_WAIT` s (the tuner asks again)."""
        with self.trial_ended:
            self.trial_ended.wait(IDLE_WAIT)

    def UpdateTrial(self, request, context):
        self._seen(trial_id=request.trial_id)
        return super().UpdateTrial(request, context)

    def EndTrial(self, request, context):
        self._seen(trial_id=request.trial.trial_id)
        _forget_retry(self.oracle, request.trial.trial_id)
        try:
            return super().EndTrial(request, context)
        finally:
            with self.trial_ended:
                self.trial_ended.notify_all()

    def GetTrial(self, request, context):
        self._seen(trial_id=request.trial_id)
        return super().GetTrial(request, context)


@synchronized
def _should_wait(oracle, tuner_id: str) -> bool:
    """True when `tuner_id` must wait instead of being told to stop.

    keras-tuner stops a tuner as soon as `max_trials` trials exist, even
    while other tuners still run trials that may fail and be queued for a
    retry: with nobody left to run it, the retry would be lost. Tuners wait
    (an IDLE trial) until no running trial can come back.
    """
    if tuner_id in oracle.ongoing_trials or kt.retry_queue(oracle):
        return False
    if not oracle.max_trials or len(oracle.trials) < oracle.max_trials:
        return False
    if oracle.max_retries_per_trial <= 0:
        return False
    return any(other != tuner_id for other in oracle.ongoing_trials)


@synchronized
def _known_tuners(oracle) -> set:
    return set(oracle.tuner_ids) | set(oracle.ongoing_trials)


@synchronized
def _forget_retry(oracle, trial_id) -> None:
    # A worker that outlived a chief restart ends a trial that the reloaded
    # chief had queued for a retry: it is done, do not run it again.
    queue = kt.retry_queue(oracle)
    while trial_id in queue:
        queue.remove(trial_id)


@synchronized
def _reap(oracle, tuner_id: str, message: str) -> str | None:
    """Ends `tuner_id`'s running trial as INVALID and forgets the tuner."""
    trial = oracle.ongoing_trials.get(tuner_id)
    ended = None
    if trial is not None:
        ended = kt.Trial.from_proto(trial.to_proto())
        ended.status = kt.TrialStatus.INVALID
        ended.message = message
        oracle.end_trial(ended)
    oracle.tuner_ids.discard(tuner_id)
    return None if ended is None else ended.trial_id


@synchronized
def _search_over(oracle) -> bool:
    return not oracle.ongoing_trials and not oracle.tuner_ids


def serve(oracle, *, worker_timeout: float, poll: float = 0.2) -> None:
    """Runs the oracle service at KERASTUNER_ORACLE_IP:PORT until the end."""
    address = oracle_address()
    value = secret()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=_SERVER_THREADS),
                         interceptors=[_RequireSecret(value)] if value else None)
    servicer = _Servicer(oracle)
    kt.protos.get_service_grpc().add_OracleServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if not port:
        raise RuntimeError(
            f"keras_dist.tuner: the chief could not serve the oracle at "
            f"{address} (KERASTUNER_ORACLE_IP, KERASTUNER_ORACLE_PORT): the "
            "port is in use or the address is not this machine's. Pick a "
            "free port, or let keras-dist tune pick one."
        )
    server.start()
    _say(f"oracle serving at {address}")
    try:
        while True:
            time.sleep(poll)
            for tuner_id in servicer.silent(worker_timeout):
                trial_id = _reap(
                    oracle,
                    tuner_id,
                    f"tuner worker {tuner_id!r} stopped responding (silent "
                    f"for more than worker_timeout={worker_timeout:g}s)",
                )
                _say(
                    f"tuner worker {tuner_id!r} has been silent for more than "
                    f"{worker_timeout:g}s: "
                    + (
                        f"trial {trial_id} ended as invalid (retried up to "
                        "max_retries_per_trial times, else failed)"
                        if trial_id is not None
                        else "forgotten"
                    )
                )
            if servicer.stop_triggered and _search_over(oracle):
                break
    finally:
        server.stop(grace=1.0).wait()
    _say("search finished; oracle stopped")


def _say(message: str) -> None:
    print(f"[keras_dist.tuner] {message}", flush=True)


class _DeadlineStub:
    """The gRPC stub, with our deadline on every call and a clear error."""

    def __init__(self, stub, timeout: float, address: str):
        self._stub = stub
        self._timeout = timeout
        self._address = address

    def __getattr__(self, name):
        method = getattr(self._stub, name)

        def call(request, **kwargs):
            kwargs["timeout"] = self._timeout
            kwargs.setdefault("wait_for_ready", True)
            try:
                return method(request, **kwargs)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code in (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.UNAVAILABLE,
                ):
                    raise ConnectionError(
                        f"keras_dist.tuner: the oracle at {self._address} did "
                        f"not answer {name} within call_timeout="
                        f"{self._timeout:g}s ({code.name}). The chief has "
                        "stopped or is unreachable."
                    ) from e
                raise

        return call


class Client(kt.oracle_client.OracleClient):
    """keras-tuner's `OracleClient` with bounded waits and a heartbeat."""

    def __init__(
        self,
        oracle,
        *,
        connect_timeout: float,
        call_timeout: float,
        heartbeat_interval: float,
    ):
        # keras-tuner's __init__ builds a channel and a stub with a one-hour
        # deadline; ours keeps the channel to check it is reachable.
        self._oracle = oracle
        self.tuner_id = os.environ["KERASTUNER_TUNER_ID"]
        self.multi_worker = False
        self.should_report = True
        address = oracle_address()
        self._channel = channel(address)
        ready = grpc.channel_ready_future(self._channel)
        try:
            try:
                ready.result(timeout=min(connect_timeout, _WAIT_NOTICE_AFTER))
            except grpc.FutureTimeoutError:
                if connect_timeout <= _WAIT_NOTICE_AFTER:
                    raise
                _say(f"waiting for the oracle at {address} (the chief) to answer, up "
                     f"to connect_timeout={connect_timeout:g}s")
                ready.result(timeout=connect_timeout - _WAIT_NOTICE_AFTER)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ConnectionError(
                f"keras_dist.tuner: could not reach the oracle at {address} "
                f"(KERASTUNER_ORACLE_IP, KERASTUNER_ORACLE_PORT) within "
                f"connect_timeout={connect_timeout:g}s. Start the chief "
                "(KERASTUNER_TUNER_ID=chief; keras-dist tune starts it for "
                "you), check the address, or raise connect_timeout."
            ) from None
        self.stub = _DeadlineStub(
            kt.protos.get_service_grpc().OracleStub(self._channel), call_timeout, address
        )
        self._heartbeat_interval = heartbeat_interval
        self._beat: tuple[threading.Thread, threading.Event] | None = None

    def create_trial(self, tuner_id):
        trial = super().create_trial(tuner_id)
        if trial.status == kt.TrialStatus.IDLE:
            time.sleep(0.25)  # asked to wait: do not spin on the chief
        return trial

    def start_heartbeat(self, trial_id: str) -> None:
        self.stop_heartbeat()
        stop = threading.Event()
        request = kt.protos.get_service().GetTrialRequest(trial_id=trial_id)

        def beat():
            while not stop.wait(self._heartbeat_interval):
                try:
                    self.stub.GetTrial(request)
                except (ConnectionError, grpc.RpcError):
                    # The trial's own next call to the chief reports it.
                    return

        thread = threading.Thread(target=beat, name="kd-tuner-heartbeat", daemon=True)
        thread.start()
        self._beat = (thread, stop)

    def stop_heartbeat(self) -> None:
        if self._beat is not None:
            thread, stop = self._beat
            stop.set()
            thread.join(timeout=5)
            self._beat = None
