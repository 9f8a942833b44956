"""Puts a callback's batch-end work after every other callback's.

`BackupAndRestore` holds the other callbacks' state, so a backup due at a
batch is written once all of them have seen it (Keras calls them in list
order, and some are listed after it). The same wrappers hide from them the
batches a resumed run skips (`hide_until`): callbacks whose state was
restored would count them twice. If a callback raises, the work due at that
batch is done before the error propagates. Only the callbacks of a
`DistributedModel.fit` are known (a plain `keras.Model.fit` passes none).
"""

from __future__ import annotations

_UNSET = object()


class SiblingHooks:
    def __init__(self):
        self._hooked = []  # (callback, hook name, what the instance held)
        self.deferred = False  # the owner's batch-end work waits for the last sibling
        self.hide_until = 0  # batches below this are hidden from the siblings

    def install(self, owner, callbacks: list, finish, hide_begin: bool) -> None:
        """Wraps the batch hooks of every callback but `owner`.

        `finish()` does the owner's pending work; it runs after the last
        callback listed after `owner` (or when a hook raises).
        `hide_begin`: wrap the begin hooks too (a resumed run that skips).
        """
        siblings = [c for c in callbacks if c is not owner]
        after = owner in callbacks and callbacks[-1] is not owner
        last = siblings[-1] if siblings and after else None
        hooks = ("on_train_batch_begin", "on_train_batch_end") if hide_begin else (
            "on_train_batch_end",)
        for callback in siblings:
            for hook in hooks:
                ending = hook == "on_train_batch_end"
                self._wrap(callback, hook, finish, ending, ending and callback is last)
        self.deferred = last is not None

    def _wrap(self, callback, hook: str, finish, ending: bool, tail: bool) -> None:
        original = getattr(callback, hook)

        def hooked(batch, logs=None):
            if batch < self.hide_until:
                return None
            if not ending:
                return original(batch, logs)
            try:
                result = original(batch, logs)
            except BaseException:
                finish()
                raise
            if tail:
                finish()
            return result

        # Keep a hook set on the instance (LambdaCallback) to put back.
        self._hooked.append((callback, hook, callback.__dict__.get(hook, _UNSET)))
        setattr(callback, hook, hooked)

    def remove(self) -> None:
        for callback, hook, previous in reversed(self._hooked):
            if previous is _UNSET:
                # The instance attribute shadows the class method; drop it.
                callback.__dict__.pop(hook, None)
            else:
                callback.__dict__[hook] = previous
        self._hooked = []
        self.deferred = False
        self.hide_until = 0
