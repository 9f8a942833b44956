"""Preemption signals during one `fit`: noted, handled at a step boundary."""

from __future__ import annotations

import signal
import threading

import keras

UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def checked_signals(values) -> tuple:
    """`preemption_signals` (one signal or several) as `signal.Signals`, or a
    ValueError naming the argument."""
    if isinstance(values, int) and not isinstance(values, bool):
        values = (values,)  # one signal: signal.SIGTERM or its number
    if values is None:
        values = ()
    if isinstance(values, (str, bytes)) or not _iterable(values):
        raise ValueError(
            "Invalid value for argument `preemption_signals`. Expected a "
            "signal or a sequence of signals, such as signal.SIGTERM or "
            f"(signal.SIGTERM, signal.SIGUSR1). Received: preemption_signals={values!r}."
        )
    signals = []
    for value in values:
        try:
            if isinstance(value, bool):
                raise TypeError
            sig = signal.Signals(value)
        except (ValueError, TypeError):
            raise ValueError(
                "Invalid value for argument `preemption_signals`. Expected "
                "signal numbers such as signal.SIGTERM. Received: "
                f"preemption_signals={values!r}, whose {value!r} is not one."
            ) from None
        if sig in UNCATCHABLE:
            raise ValueError(
                "Invalid value for argument `preemption_signals`: "
                f"{sig.name} cannot be caught. Received: preemption_signals={values!r}. "
                "Use SIGTERM, SIGUSR1 or another catchable signal."
            )
        signals.append(sig)
    return tuple(signals)


def _iterable(value) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


class PreemptionSignals:
    """Handlers that set `received` while a Keras `fit` runs.

    A second signal, or one that arrives after the fit that installed the
    handlers ended with an exception (Keras calls no hook then), gets the
    previous handler, as if the callback were not there.
    """

    def __init__(self):
        self.received = threading.Event()
        self._previous = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self, signals, warn) -> None:
        self.received = threading.Event()
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            warn(
                "thread",
                "BackupAndRestore: fit runs outside the main thread, so "
                "preemption signals cannot be handled; backups still follow "
                "`save_freq`.",
            )
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received.is_set() or not _inside_fit(frame):
            self.restore()
            signal.raise_signal(signum)
            return
        self.received.set()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}


def _inside_fit(frame) -> bool:
    """Whether Keras' `fit` is on the interrupted thread's stack."""
    fit = keras.Model.fit.__code__
    while frame is not None:
        if frame.f_code is fit:
            return True
        frame = frame.f_back
    return False
