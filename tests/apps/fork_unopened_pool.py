"""A pool made before a fork and opened only in the child, as a Worker built in a parent
and run in a forked child has it. Prints what the child's first statement returned, then
what the parent's pool, opened after the fork, answers: a pool belongs to the process
that opened it."""

from __future__ import annotations

import os
import sys

from relay_core.pools import make_pool
from relay_core.settings import database_url

made_before = make_pool(database_url(), name="made-before-fork", min_size=1, max_size=1, timeout=5)
child = os.fork()
if child == 0:
    made_before.open()
    with made_before.connection() as conn:
        print("child", conn.execute("SELECT 1").fetchone()[0], flush=True)
    made_before.close()
    sys.exit(0)
_, status = os.waitpid(child, 0)
made_before.open()
with made_before.connection() as conn:
    print("parent", conn.execute("SELECT 2").fetchone()[0], os.waitstatus_to_exitcode(status), flush=True)
made_before.close()
