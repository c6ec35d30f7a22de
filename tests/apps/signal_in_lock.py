"""A worker whose SIGTERM arrives while its main thread holds the wake event's lock.

The claim loop clears its wake event before every claim. Here that clear sends
SIGTERM to this process from inside the event's lock and runs a few bytecodes
before letting go, so the signal handler runs on the main thread at the one
moment a handler that set the event itself would wait forever for a lock its
own thread holds. Prints "stopped" and exits 0 when the worker shut down.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from relay_core import Relay
from relay_core.logs import configure


class SignalInsideLock(threading.Event):
    """An Event whose first clear() delivers SIGTERM while holding the event's lock."""

    tripped = False

    def clear(self) -> None:
        with self._cond:  # type: ignore[attr-defined]
            if not SignalInsideLock.tripped:
                SignalInsideLock.tripped = True
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs at one of these bytecode boundaries
                    pass
            self._flag = False  # type: ignore[attr-defined]


def main() -> int:
    configure("INFO")
    relay = Relay(sys.argv[1])
    worker = relay.worker(concurrency=1, worker_id="signal-in-lock", listen=False)
    worker._wake = SignalInsideLock()
    worker.run()
    relay.close()
    print("stopped" if worker.stopped.is_set() else "not stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
