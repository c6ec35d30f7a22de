"""SIGTERM and SIGINT, acted on outside the signal handler.

Python runs a signal handler on the main thread between two bytecodes, which
can be while that thread holds a lock. ``threading.Event.set()`` takes the
event's own (non-reentrant) lock, so a handler that sets an event the main
thread was just clearing or starting to wait on blocks forever on a lock its
own thread holds: the process then ignores every later SIGTERM and only
SIGKILL ends it, after a platform's drain window, with its jobs still leased.

The handler installed here therefore only writes the signal's number to a
pipe. A watcher thread reads it and runs the callback in ordinary thread
context, where waiting a moment for a lock the main thread holds is harmless.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from .logs import logger

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ShutdownSignals:
    """The installed handlers; :meth:`close` puts the previous ones back."""

    def __init__(self, callback: Callable[[int], None], signums: tuple[int, ...] = SHUTDOWN_SIGNALS) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        self._callback = callback
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous: dict[int, Any] = {signum: signal.signal(signum, self._handle) for signum in signums}
        self._watcher = threading.Thread(target=self._watch, name="relay-signals", daemon=True)
        self._watcher.start()

    def _handle(self, signum: int, _frame: object) -> None:
        # No locks here: a write to a pipe is all the main thread does.
        with contextlib.suppress(OSError):  # a full pipe already holds signals to act on; a closed one, none
            os.write(self._write_fd, bytes([signum]))

    def _watch(self) -> None:
        while True:
            received = os.read(self._read_fd, 64)
            if not received:  # close(): the write end is gone
                os.close(self._read_fd)
                return
            for signum in received:
                try:
                    self._callback(signum)
                except Exception:  # one failed callback must not leave later signals unheard
                    logger.exception("shutdown signal handler failed", extra={"signal": signum})

    def close(self) -> None:
        """Restore the previous handlers and stop the watcher."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        os.close(self._write_fd)
