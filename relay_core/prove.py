"""`relay prove`: several worker processes drain many jobs; the audit counts duplicates.

Each proof job's handler inserts an execution row in its own transaction,
apart from the job's completion, so a job claimed twice would show up as two
rows. With no crashes the audit must find zero duplicates and every job
succeeded.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psycopg
from psycopg_pool import ConnectionPool

from .client import Relay
from .connect_options import connection_options
from .job import Job
from .queries import sql
from .worker.config import WorkerConfig

PROOF_QUEUE = "relay_proof"
PROOF_TYPE = "relay.proof"

#: The proof's process id, as its workers' environment gives it (see ``stop_when_orphaned``).
PROOF_PARENT = "RELAY_PROOF_PARENT"
#: How often a proof's worker looks whether the proof is still there.
ORPHAN_CHECK_SECONDS = 1.0

app = Relay()
_pool: ConnectionPool | None = None


def stop_when_orphaned(parent: int) -> None:
    """In a proof's worker: SIGTERM this process once the proof (``parent``) is gone.

    A proof ended by SIGTERM stops its workers itself; one killed outright
    (SIGKILL, the OOM killer) cannot, and its workers went on serving the
    proof's queue on the user's database for as long as they ran. The
    signal starts the worker's own graceful stop.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="relay-proof-parent", daemon=True).start()


# Taken out of the environment as it is read: a process this one starts is no proof's worker.
if (_parent := os.environ.pop(PROOF_PARENT, "")).isdigit():
    stop_when_orphaned(int(_parent))


@app.handler(PROOF_TYPE, max_attempts=5)
def record_execution(job: Job) -> None:
    """Write one executions row for this run (the side effect the audit counts)."""
    global _pool
    if _pool is None:
        _pool = ConnectionPool(
            app.dsn, min_size=1, max_size=8, open=True, name="relay-proof", kwargs=connection_options(app.dsn)
        )
        atexit.register(_pool.close)
    with _pool.connection() as conn:
        conn.execute(
            sql("proof_record_execution"),
            {"job_id": job.id, "worker": f"{os.getpid()}", "attempt": job.attempt},
        )


@dataclass
class ProofResult:
    """What the audit found.

    A job is lost when it ended other than succeeded, or it is marked
    succeeded or its row is gone without its having run (retention prunes
    finished jobs: one it pruned after its run counts as succeeded, and
    ``pruned`` says how many). One still
    queued or claimed when the proof stopped (its time ran out, or its workers
    exited) is unfinished, not lost: the proof could not tell, and says why it
    stopped instead.
    """

    workers: int
    jobs: int
    duplicates: list[tuple[int, int]]
    succeeded: int
    lost: int
    seconds: float
    unfinished: int = 0
    stopped: str = ""
    pruned: int = 0

    def report(self) -> str:
        """The lines `relay prove` prints."""
        lines = [
            f"workers:          {self.workers} processes",
            f"jobs:             {self.jobs}",
            f"succeeded:        {self.succeeded}"
            + (f" ({self.pruned} of them pruned by retention after they ran)" if self.pruned else ""),
            f"duplicates found: {len(self.duplicates)}",
            f"jobs lost:        {self.lost}",
        ]
        if self.unfinished:
            lines.append(
                f"unfinished:       {self.unfinished} still queued or claimed: {self.stopped}"
                " (deleted, not left queued)"
            )
        lines += [
            f"seconds:          {self.seconds:.1f}",
            f"audit query:      {sql('proof_duplicates').rstrip(';')}",
            f"audit rows:       {self.duplicates if self.duplicates else '(none)'}",
        ]
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        """Zero duplicates, nothing lost and every job run."""
        return not self.duplicates and self.lost == 0 and self.unfinished == 0


def run_proof(
    dsn: str, *, workers: int = 3, jobs: int = 5000, concurrency: int = 4, timeout: float = 300.0
) -> ProofResult:
    """Enqueue ``jobs`` proof jobs, drain them with ``workers`` processes, audit.

    The workers' RELAY_* settings are checked first: a bad one stopped every
    worker at its start, after the jobs were enqueued.
    """
    WorkerConfig.from_env(concurrency=concurrency, queues=(PROOF_QUEUE,))
    with psycopg.connect(dsn, **connection_options(dsn)) as conn:
        conn.execute(sql("proof_setup"))
    try:
        result = _drain_and_audit(dsn, workers, jobs, concurrency, timeout)
    except BaseException:  # Ctrl-C included
        with contextlib.suppress(psycopg.Error):
            _remove_unfinished(dsn)
        raise
    _remove_unfinished(dsn)
    return result


def _remove_unfinished(dsn: str) -> None:
    """Delete the proof jobs still queued or claimed once its workers are gone.

    Nothing else serves the proof's queue: left there, they would wait
    until the next proof, and a queue with jobs and no worker is what an
    operator's alert watches for.
    """
    with psycopg.connect(dsn, autocommit=True, **connection_options(dsn)) as conn:
        conn.execute(sql("proof_remove_unfinished"))


def _drain_and_audit(dsn: str, workers: int, jobs: int, concurrency: int, timeout: float) -> ProofResult:
    """``run_proof``'s enqueue, drain and audit, its workers stopped before it returns or raises."""
    relay = Relay(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True, **connection_options(dsn)) as conn:
            for start in range(0, jobs, 5000):
                batch = [
                    {"type": PROOF_TYPE, "queue": PROOF_QUEUE, "payload": {"n": n}}
                    for n in range(start, min(jobs, start + 5000))
                ]
                conn.execute(sql("proof_enqueued"), {"ids": relay.enqueue_many(batch)})
    finally:
        relay.close()
    env = dict(os.environ, RELAY_DATABASE_URL=dsn)
    command = [
        sys.executable,
        "-m",
        "relay_core",
        "--log-level",
        "warning",
        "worker",
        "--app",
        "relay_core.prove:app",
        "--queues",
        PROOF_QUEUE,
        "--concurrency",
        str(concurrency),
    ]
    env[PROOF_PARENT] = str(os.getpid())  # see stop_when_orphaned
    started = time.monotonic()
    procs = [subprocess.Popen(command, env=env) for _ in range(workers)]
    stopped = f"the proof stopped after {timeout:.0f} s (--timeout)"
    try:
        with psycopg.connect(dsn, autocommit=True, **connection_options(dsn)) as conn:
            while time.monotonic() - started < timeout:
                finished, _succeeded, total = conn.execute(sql("proof_progress")).fetchone()
                if finished >= total:
                    break
                if all(p.poll() is not None for p in procs):
                    codes = sorted({p.returncode for p in procs})
                    stopped = f"every worker exited (exit codes {', '.join(map(str, codes))}; see their output above)"
                    break
                time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    with psycopg.connect(dsn, autocommit=True, **connection_options(dsn)) as conn:
        duplicates = [(r[0], r[1]) for r in conn.execute(sql("proof_duplicates")).fetchall()]
        succeeded, pruned, lost, unfinished = conn.execute(sql("proof_outcome")).fetchone()
    return ProofResult(workers, jobs, duplicates, succeeded, lost, elapsed, unfinished, stopped, pruned)
