-- The admin surface's statements: listings, bulk actions and the counters that
-- keep /queues, /stats and /metrics off full-table counts. Same format as
-- queries.sql; relay_core/monitor.py runs them. Filters pass NULL for "any":
-- monitor.py sends these statements unprepared, so PostgreSQL plans each call
-- with its real values and drops the NULL branches.
-- Jobs found by id compare status as text: see the note in queries.sql.

-- name: job_list
-- One page of jobs, newest first, by keyset on id (stable under inserts, no
-- OFFSET scan). %(q)s matches the type or the error text, case-insensitively,
-- as a plain substring (strpos, so LIKE wildcards in it mean nothing).
SELECT id, type, queue, priority, status::text AS status, attempts, max_attempts,
       run_at, created_at, started_at, finished_at, claimed_by,
       left(last_error, %(error_chars)s) AS last_error
FROM relay.jobs
WHERE (%(status)s::relay.job_status IS NULL OR status = %(status)s::relay.job_status)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(type)s::text IS NULL OR type = %(type)s::text)
  AND (%(q)s::text IS NULL
       OR strpos(lower(type), lower(%(q)s::text)) > 0
       OR strpos(lower(last_error), lower(%(q)s::text)) > 0)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: job_list_recently_dead
-- The jobs that died last, latest first: the dashboard's newest dead jobs and
-- its count by type. Ordered by when they died, not by id: a job enqueued
-- long ago that died a moment ago is the one on call needs to see, and by id
-- it sat behind every dead job enqueued after it. Read from jobs_finished_idx
-- backwards. A dead job without finished_at (written by hand) is not listed.
SELECT id, type, queue, priority, status::text AS status, attempts, max_attempts,
       run_at, created_at, started_at, finished_at, claimed_by,
       left(last_error, %(error_chars)s) AS last_error
FROM relay.jobs
WHERE status = 'dead' AND finished_at IS NOT NULL
ORDER BY finished_at DESC, id DESC
LIMIT %(limit)s;

-- name: job_max_id
-- The newest job id and the database's time: bulk actions touch only jobs that
-- existed when they began, and a requeue only jobs that had ended by then.
SELECT coalesce(max(id), 0) AS max_id, now() AS began_at FROM relay.jobs;

-- name: job_requeue_matching
-- Admin, in bulk: up to %(batch)s dead or cancelled jobs matching the filter
-- (ids in (%(after)s, %(max_id)s]) run again now with fresh attempts; their error
-- history is kept. The SET list is job_requeue's, row for row. Returns how many
-- changed and the last id looked at, so the caller walks the table in short
-- transactions instead of one long one. A row someone holds (an admin acting on
-- one job, retention deleting it) is waited for, then checked again: skipped,
-- it would stay dead while the answer counted the batch as done. Rows are
-- locked in id order, as every bulk action's are, so two never deadlock.
-- Jobs that ended after %(finished_by)s are left alone: the walk's start, or
-- earlier when the caller gives it (the dashboard's "Requeue all" passes the
-- time its page was read, so the jobs it requeues are at most the ones it counted).
-- A job with no finished_at (written by hand) ended at some time before: it is taken.
-- transition: dead -> queued
-- transition: cancelled -> queued
WITH picked AS (
    SELECT id FROM relay.jobs
    WHERE status IN ('dead', 'cancelled')
      AND (%(status)s::relay.job_status IS NULL OR status = %(status)s::relay.job_status)
      AND (%(finished_by)s::timestamptz IS NULL
           OR coalesce(finished_at, '-infinity') <= %(finished_by)s::timestamptz)
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND (%(type)s::text IS NULL OR type = %(type)s::text)
      AND (%(q)s::text IS NULL
           OR strpos(lower(type), lower(%(q)s::text)) > 0
           OR strpos(lower(last_error), lower(%(q)s::text)) > 0)
      AND id > %(after)s AND id <= %(max_id)s
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE
), requeued AS (
    UPDATE relay.jobs AS j
    -- Not before a shutdown's still-running thread has stopped (see job_requeue).
    SET status = 'queued', attempts = 0, run_at = greatest(now(), j.claimed_until), started_at = NULL,
        finished_at = NULL, claimed_by = NULL, claimed_until = CASE WHEN j.claimed_until > now() THEN j.claimed_until END,
        cancel_requested_at = NULL, progress = NULL, result = NULL
    FROM picked
    WHERE j.id = picked.id AND j.status::text IN ('dead', 'cancelled')
    RETURNING j.id, j.queue
), notified AS (
    SELECT count(pg_notify('relay_jobs', queue)) AS n FROM (SELECT DISTINCT queue FROM requeued) AS woken
)
SELECT (SELECT count(*) FROM requeued) AS changed,
       (SELECT count(*) FROM picked) AS picked,
       (SELECT max(id) FROM picked) AS last_id,
       (SELECT n FROM notified) AS notified;

-- name: job_cancel_matching
-- Admin, in bulk: up to %(batch)s queued jobs matching the filter (ids in
-- (%(after)s, %(max_id)s]) will not run. A row someone holds is waited for,
-- then checked again: a claim locks more queued rows than it takes (every
-- queue's candidates, and jobs its type limits hold back), and for the length
-- of one statement, so a job it took is skipped as no longer queued, and one it
-- only looked at is cancelled. Skipped instead, such jobs stayed queued while
-- the answer counted the batch as done. A claim never waits for a lock, so it
-- cannot deadlock with this.
-- transition: queued -> cancelled
WITH picked AS (
    SELECT id FROM relay.jobs
    WHERE status = 'queued'
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND (%(type)s::text IS NULL OR type = %(type)s::text)
      AND (%(q)s::text IS NULL
           OR strpos(lower(type), lower(%(q)s::text)) > 0
           OR strpos(lower(last_error), lower(%(q)s::text)) > 0)
      AND id > %(after)s AND id <= %(max_id)s
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE
), cancelled AS (
    UPDATE relay.jobs AS j SET status = 'cancelled', finished_at = now()
    FROM picked
    WHERE j.id = picked.id AND j.status::text = 'queued'
    RETURNING j.id
)
SELECT (SELECT count(*) FROM cancelled) AS changed,
       (SELECT count(*) FROM picked) AS picked,
       (SELECT max(id) FROM picked) AS last_id;

-- name: job_created_here
-- Whether this transaction wrote the job's current row version: true right
-- after an enqueue inserted it, false when an idempotency key returned an
-- older job (exact, unlike comparing timestamps).
SELECT xmin = pg_current_xact_id()::xid AS created_here FROM relay.jobs WHERE id = %(id)s;

-- name: job_counts_fold_lock
-- Only one folder at a time; the others read the unfolded deltas (still exact).
SELECT pg_try_advisory_xact_lock(%(key)s) AS locked;

-- name: job_counts_fold
-- Replace up to %(rows)s committed count deltas (all of them when NULL) with
-- one row per (queue, state). Deltas that commit meanwhile are not seen and
-- stay for the next fold. Picked by ctid so a bounded fold is one TID scan.
WITH folded AS (
    DELETE FROM relay.job_counts
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM relay.job_counts LIMIT %(rows)s))
    RETURNING queue, state, n
), kept AS (
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, state, sum(n) FROM folded GROUP BY queue, state HAVING sum(n) <> 0
)
SELECT count(*) AS folded FROM folded;

-- name: job_counts_recount_lock
-- Rebuilding the counters waits for a fold in progress (job_counts_fold_lock's
-- key), and folds wait for it: a fold committed after the rebuild's snapshot
-- would put back sums of deltas the rebuild also counted.
SELECT pg_advisory_xact_lock(%(key)s);

-- name: job_counts_recount
-- Replace every count delta with the jobs table's own count, per (queue, state);
-- returns what the counters said before and what they say now where the two differ.
-- One statement, one snapshot: a writer's jobs and their deltas commit together,
-- so the deltas it deletes are those of the jobs it counts, and a delta committed
-- after it stays, as its jobs are not counted. Writers never wait for it.
WITH cleared AS (
    DELETE FROM relay.job_counts RETURNING queue, state, n
), was AS (
    SELECT queue, state, sum(n) AS n FROM cleared GROUP BY queue, state
), truth AS (
    SELECT queue, status AS state, count(*) AS n FROM relay.jobs GROUP BY queue, status
), recounted AS (
    INSERT INTO relay.job_counts (queue, state, n) SELECT queue, state, n FROM truth
)
SELECT coalesce(truth.queue, was.queue) AS queue, coalesce(truth.state, was.state)::text AS state,
       coalesce(was.n, 0)::bigint AS was, coalesce(truth.n, 0)::bigint AS now
FROM truth FULL JOIN was ON was.queue = truth.queue AND was.state = truth.state
WHERE coalesce(was.n, 0) <> coalesce(truth.n, 0)
ORDER BY 1, 2;

-- name: job_outcomes_fold
-- Replace up to %(rows)s committed outcome deltas (all of them when NULL) with
-- one row per (minute, queue, type); minutes older than %(keep_minutes)s fold
-- into one '-infinity' row per (queue, type) that keeps the all-time totals.
WITH folded AS (
    DELETE FROM relay.job_outcomes
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM relay.job_outcomes LIMIT %(rows)s))
    RETURNING minute, queue, type, succeeded, failed, dead
), kept AS (
    INSERT INTO relay.job_outcomes (minute, queue, type, succeeded, failed, dead)
    SELECT CASE WHEN minute < date_trunc('minute', now()) - make_interval(mins => %(keep_minutes)s::int)
                THEN '-infinity'::timestamptz ELSE minute END AS bucket,
           queue, type, sum(succeeded), sum(failed), sum(dead)
    FROM folded
    GROUP BY bucket, queue, type
)
SELECT count(*) AS folded FROM folded;

-- name: job_counts_by_queue
-- Jobs per (queue, state) from the counters, never from relay.jobs.
SELECT queue, state::text AS state, sum(n)::bigint AS n
FROM relay.job_counts
GROUP BY queue, state
HAVING sum(n) <> 0
ORDER BY queue, state;

-- name: queue_service
-- Per queue, how it is being served: the run_at of the job that has waited
-- longest among those due now, and how many live workers serve it.
-- The wait: a loose index scan over jobs_runnable_idx: hop from one priority
-- to the next, take each priority's earliest run_at, keep the earliest that
-- is due. Cost grows with the number of distinct priorities, not with the
-- backlog (a queue with nothing queued costs one probe).
-- The workers: alive by relay.worker_state, as on the workers page, counted
-- for all the queues in one read of the registry (which keeps a week of
-- workers; a read per queue made a scrape's cost queues x workers). A worker
-- that names a queue twice serves it once. A queue that holds queued jobs and
-- has none is one nothing will drain: a queue name mistyped at enqueue, or a
-- cron handler's queue no worker was started for.
-- The lapsed leases: claimed jobs whose lease ran out, whose worker stopped
-- heartbeating (killed, hung, cut off) and which no live worker's sweeper has
-- put back yet; read from jobs_lease_idx, so only lapsed leases are visited.
WITH serving AS (
    SELECT served.queue, count(DISTINCT w.id)::int AS live_workers
    FROM relay.workers AS w
    CROSS JOIN LATERAL unnest(w.queues) AS served(queue)
    WHERE relay.worker_state(w.stopped_at, w.last_seen_at, w.heartbeat_seconds, %(stale_seconds)s::float8) = 'alive'
    GROUP BY served.queue
)
SELECT q.queue, (
    WITH RECURSIVE priorities AS (
        (SELECT priority FROM relay.jobs
         WHERE queue = q.queue AND status = 'queued' ORDER BY priority LIMIT 1)
        UNION ALL
        SELECT (SELECT j.priority FROM relay.jobs AS j
                WHERE j.queue = q.queue AND j.status = 'queued' AND j.priority > p.priority
                ORDER BY j.priority LIMIT 1)
        FROM priorities AS p WHERE p.priority IS NOT NULL
    )
    SELECT min(earliest.run_at) FROM priorities AS p
    CROSS JOIN LATERAL (
        SELECT j.run_at FROM relay.jobs AS j
        WHERE j.queue = q.queue AND j.status = 'queued' AND j.priority = p.priority
        ORDER BY j.run_at LIMIT 1
    ) AS earliest
    WHERE earliest.run_at <= now()
) AS oldest_run_at,
coalesce(s.live_workers, 0) AS live_workers,
(SELECT count(*) FROM relay.jobs AS j
 WHERE j.status = 'claimed' AND j.claimed_until < now() AND j.queue = q.queue)::int AS lapsed_leases,
now() AS now
FROM unnest(%(queues)s::text[]) AS q(queue)
LEFT JOIN serving AS s ON s.queue = q.queue;

-- name: job_outcomes_per_minute
-- Succeeded, failed and dead attempts in each of the last %(minutes)s minutes
-- (the current one included), zeros where nothing happened.
WITH minutes AS (
    SELECT generate_series(date_trunc('minute', now()) - make_interval(mins => %(minutes)s::int - 1),
                           date_trunc('minute', now()), interval '1 minute') AS minute
)
SELECT m.minute,
       coalesce(sum(o.succeeded), 0)::bigint AS succeeded,
       coalesce(sum(o.failed), 0)::bigint AS failed,
       coalesce(sum(o.dead), 0)::bigint AS dead
FROM minutes AS m
LEFT JOIN relay.job_outcomes AS o ON o.minute = m.minute
GROUP BY m.minute
ORDER BY m.minute;

-- name: job_outcome_totals
-- All-time attempts finished per (queue, type), for Prometheus counters.
SELECT queue, type,
       sum(succeeded)::bigint AS succeeded, sum(failed)::bigint AS failed, sum(dead)::bigint AS dead
FROM relay.job_outcomes
GROUP BY queue, type
ORDER BY queue, type;

-- name: worker_list
-- The worker registry, live workers first. A worker is alive while it keeps
-- heartbeating, stopped after a graceful shutdown, and gone when it went quiet
-- without one (killed, or its machine vanished): relay.worker_state decides
-- (migration 0015).
-- claimed: the jobs claimed by it now, from relay.jobs (one pass over the
-- claimed jobs, which are few: the workers' slots and what they hold for
-- them); in_flight is what it reported at its last heartbeat.
SELECT id, host, pid, queues, concurrency, in_flight, coalesce(c.claimed, 0) AS claimed,
       started_at, last_seen_at, stopped_at, state, now() AS now
FROM (
    SELECT w.*, relay.worker_state(stopped_at, last_seen_at, heartbeat_seconds, %(stale_seconds)s::float8) AS state
    FROM relay.workers AS w
) AS w
LEFT JOIN (
    SELECT claimed_by, count(*) AS claimed FROM relay.jobs WHERE status = 'claimed' GROUP BY claimed_by
) AS c ON c.claimed_by = w.id
ORDER BY state = 'alive' DESC, last_seen_at DESC, id
LIMIT %(limit)s;

-- name: worker_counts
-- How many registered workers are alive, stopped and gone.
SELECT count(*) FILTER (WHERE state = 'alive') AS alive,
       count(*) FILTER (WHERE state = 'stopped') AS stopped,
       count(*) FILTER (WHERE state = 'gone') AS gone
FROM (
    SELECT relay.worker_state(stopped_at, last_seen_at, heartbeat_seconds, %(stale_seconds)s::float8) AS state
    FROM relay.workers
) AS w;

-- name: database_ping
-- The readiness check's round trip.
SELECT 1 AS ok;
