"""A producer that enqueues, forks, and enqueues from both processes at once.

What ``gunicorn --preload`` or ``multiprocessing`` (fork) does to a Relay
that was used before the fork. The child exits the ordinary way (not
``os._exit``), so whatever it inherited is finalized as at any exit.
Prints the child's exit status.
"""

from __future__ import annotations

import os
import sys

from relay_core import Relay

EACH = 200

relay = Relay()
relay.enqueue("forked", {"who": "parent", "n": -1})
child = os.fork()
if child == 0:
    for n in range(EACH):
        relay.enqueue("forked", {"who": "child", "n": n})
    sys.exit(0)
for n in range(EACH):
    relay.enqueue("forked", {"who": "parent", "n": n})
_, status = os.waitpid(child, 0)
# After the child's exit, the parent's connections still work.
relay.enqueue("forked", {"who": "parent", "n": EACH})
relay.close()
print(os.waitstatus_to_exitcode(status))
