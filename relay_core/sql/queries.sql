-- The statements Relay runs against its tables, by name (what runs elsewhere:
-- relay_core/queries.py).
-- A block starts with "-- name: <entity>_<verb>" and a one-line description.
-- Blocks that write "status" also carry "-- transition: <from> -> <to>[, <to>]"
-- lines; tests/test_state_machine.py checks each against relay_core.states.
-- Parameters use psycopg's %(name)s style so the SQLAlchemy adapter can run the
-- same text through exec_driver_sql.
-- Statements that find their jobs by id (one, or a list they join) compare
-- status as text (status::text = 'claimed'). Written as status = 'claimed', the
-- condition lets PostgreSQL read the jobs through a partial index whose
-- predicate it matches (jobs_lease_idx, jobs_runnable_idx, the finished ones)
-- instead of the primary key, and it does once an ANALYZE saw few jobs in that
-- state: the index then looks like one row. It holds every job in the state,
-- and the entries of rows updated since the last vacuum: a completion of
-- thousands of jobs, joined against all of them, took 3 s, and a drain of
-- 20,000 jobs ran at a tenth of its speed. The text comparison matches no index
-- predicate, so the primary key is the way in.

-- name: job_insert
-- Insert one job without an idempotency key. Nothing can conflict, so this is a
-- plain INSERT: ON CONFLICT would make it a speculative insertion, which costs
-- an extra WAL record and index probe on every enqueue.
-- Every insert here counts its jobs itself (migration 0027): it writes its
-- transaction into counted_by_transaction, so the insert trigger leaves them
-- alone, and its "counted" part adds them to relay.job_counts, refusing a job
-- that breaks the table's rules as the trigger would (status 'queued' and no
-- lease, as written).
-- The NOTIFY is sent in the caller's transaction, so it fires only on commit;
-- %(notify)s is false for producers configured not to wake workers (RELAY_NOTIFY).
-- With %(published)s, the job takes the max_attempts workers published for its
-- type, if any (an enqueue that gave none, from a Relay without the handler):
-- read here rather than by a statement of its own, it costs no round trip; the
-- function reads relay.job_types only when called (migration 0012).
-- transition: (new) -> queued
WITH inserted AS (
    INSERT INTO relay.jobs (status, type, payload, queue, priority, run_at, max_attempts, counted_by_transaction)
    VALUES ('queued', %(type)s, %(payload)s::jsonb, %(queue)s, %(priority)s,
            coalesce(%(run_at)s::timestamptz, now()),
            CASE WHEN %(published)s
                 THEN relay.published_max_attempts(%(type)s, %(max_attempts)s)
                 ELSE %(max_attempts)s END,
            pg_current_xact_id())
    RETURNING id, type, queue, max_attempts, run_at
), counted AS (
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, 'queued'::relay.job_status, CASE WHEN broken IS NULL THEN 1 ELSE relay.job_refuse(id, broken) END
    FROM (SELECT id, queue, relay.job_rule_broken(type, queue, max_attempts, 'queued', NULL, NULL) AS broken
          FROM inserted) AS checked
)
SELECT id, CASE WHEN %(notify)s AND run_at <= now() THEN pg_notify('relay_jobs', queue) END AS notified
FROM inserted;

-- name: job_insert_keyed
-- Insert one job with an idempotency key; on a conflict insert nothing and return no row.
-- %(published)s and the count as in job_insert.
-- transition: (new) -> queued
WITH inserted AS (
    INSERT INTO relay.jobs (status, type, payload, queue, priority, run_at, max_attempts, idempotency_key,
                            counted_by_transaction)
    VALUES ('queued', %(type)s, %(payload)s::jsonb, %(queue)s, %(priority)s,
            coalesce(%(run_at)s::timestamptz, now()),
            CASE WHEN %(published)s
                 THEN relay.published_max_attempts(%(type)s, %(max_attempts)s)
                 ELSE %(max_attempts)s END,
            %(idempotency_key)s, pg_current_xact_id())
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, type, queue, max_attempts, run_at <= now() AS due
), counted AS (
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, 'queued'::relay.job_status, CASE WHEN broken IS NULL THEN 1 ELSE relay.job_refuse(id, broken) END
    FROM (SELECT id, queue, relay.job_rule_broken(type, queue, max_attempts, 'queued', NULL, NULL) AS broken
          FROM inserted) AS checked
)
SELECT id, CASE WHEN due AND %(notify)s THEN pg_notify('relay_jobs', queue) END AS notified FROM inserted;

-- name: wake_queues
-- The NOTIFY owed to each of %(queues)s by enqueues that left their wake-up to
-- the window's end (relay_core/wakeups.py). It writes nothing, so its commit
-- flushes nothing and holds PostgreSQL's NOTIFY lock only for a moment.
SELECT count(pg_notify('relay_jobs', queue)) AS n FROM unnest(%(queues)s::text[]) AS queue;

-- name: job_id_by_idempotency_key
-- The job that already holds an idempotency key.
SELECT id FROM relay.jobs WHERE idempotency_key = %(idempotency_key)s;

-- name: job_insert_many
-- Insert many jobs in one round trip from parallel arrays; returns the new ids
-- with their keys (in id order) and how many queues were woken. Jobs without a
-- key go in first, in input order, so their ids ascend with their positions;
-- jobs with one follow in key order, so two batches whose keys overlap take
-- the keys' locks in the same order and never deadlock each other.
-- transition: (new) -> queued
WITH input AS (
    SELECT * FROM unnest(%(types)s::text[], %(payloads)s::text[], %(queues)s::text[],
                         %(priorities)s::smallint[], %(run_ats)s::timestamptz[],
                         %(max_attempts)s::integer[], %(idempotency_keys)s::text[])
        WITH ORDINALITY AS t(type, payload, queue, priority, run_at, max_attempts, idempotency_key, ord)
), inserted AS (
    INSERT INTO relay.jobs (status, type, payload, queue, priority, run_at, max_attempts, idempotency_key,
                            counted_by_transaction)
    SELECT 'queued', type, payload::jsonb, queue, priority, coalesce(run_at, now()), max_attempts, idempotency_key,
           pg_current_xact_id()
    FROM input ORDER BY idempotency_key IS NOT NULL, idempotency_key, ord
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, type, queue, max_attempts, run_at <= now() AS due, idempotency_key
), counted AS (
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, 'queued'::relay.job_status, sum(CASE WHEN broken IS NULL THEN 1 ELSE relay.job_refuse(id, broken) END)
    FROM (SELECT id, queue, relay.job_rule_broken(type, queue, max_attempts, 'queued', NULL, NULL) AS broken
          FROM inserted) AS checked
    GROUP BY queue
), notified AS (
    SELECT count(pg_notify('relay_jobs', queue)) AS n
    FROM (SELECT DISTINCT queue FROM inserted WHERE due AND %(notify)s) AS due_queues
)
SELECT coalesce(array_agg(id ORDER BY id), '{}') AS ids,
       coalesce(array_agg(idempotency_key ORDER BY id), '{}') AS keys,
       (SELECT n FROM notified) AS notified
FROM inserted;

-- name: job_insert_many_alike
-- job_insert_many for the usual bulk enqueue: every job has the same type,
-- queue, priority, run_at and max_attempts and none has an idempotency key.
-- Only the payloads travel, as one JSON array (one document for the server's
-- JSON parser instead of an array literal whose every element the client must
-- escape); the rest are single parameters. The jobs share the values the
-- table's rules read, so they are checked once, and counted as one delta.
-- transition: (new) -> queued
WITH inserted AS (
    INSERT INTO relay.jobs (status, type, payload, queue, priority, run_at, max_attempts, counted_by_transaction)
    SELECT 'queued', %(type)s, p.payload, %(queue)s, %(priority)s,
           coalesce(%(run_at)s::timestamptz, now()), %(max_attempts)s, pg_current_xact_id()
    FROM jsonb_array_elements(%(payloads)s::jsonb) WITH ORDINALITY AS p(payload, ord)
    ORDER BY p.ord
    RETURNING id, run_at <= now() AS due
), counted AS (
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT %(queue)s, 'queued'::relay.job_status, CASE WHEN broken IS NULL THEN count(*) ELSE relay.job_refuse(min(id), broken) END
    FROM inserted,
         relay.job_rule_broken(%(type)s, %(queue)s, %(max_attempts)s, 'queued', NULL, NULL) AS broken
    GROUP BY broken
)
SELECT coalesce(array_agg(id ORDER BY id), '{}') AS ids,
       CASE WHEN bool_or(due) AND %(notify)s THEN pg_notify('relay_jobs', %(queue)s) END AS notified
FROM inserted;

-- name: job_ids_by_idempotency_keys
-- Resolve many idempotency keys to the jobs that hold them.
SELECT idempotency_key, id FROM relay.jobs WHERE idempotency_key = ANY(%(idempotency_keys)s::text[]);

-- name: job_type_max_attempts_many
-- The max_attempts workers published for the types of an enqueue that gave
-- none and whose own Relay has no handler for them; run on the insert's connection.
SELECT type, max_attempts FROM relay.job_types WHERE type = ANY(%(types)s::text[]);

-- name: job_claim
-- THE CLAIM. Take up to %(limit)s runnable jobs from the worker's unpaused
-- queues in one statement: for each queue walk jobs_runnable_idx in
-- (priority, run_at, id) order, skip rows another worker has locked and types
-- with no room under their limits, keep the best %(limit)s overall, and mark
-- them claimed with a fresh lease and fencing token. When type limits exist the
-- worker runs claim_limits_lock first, in the same transaction, and passes
-- locked = true; unlocked, the statement claims nothing while any limit exists.
-- Attempts are charged here, so a worker killed outright spends the attempt of
-- every job it holds unstarted; a job on its last attempt would end dead
-- without having run. The claim therefore stops before the job that would
-- take the worker past %(last_attempt_room)s such jobs (its idle slots plus a
-- few held ahead of them): it takes the jobs before that one, never any after
-- it, so no job is passed over and the next claim starts from it.
-- A job of a limited type is taken only where it falls among the first
-- %(idle_slots)s jobs of the claim (slots take claimed jobs in this order): it
-- counts as running, and as a start in its rate window, from its claim, so it
-- must not wait behind another job for a slot. Prefetched behind a 0.8 s job,
-- five jobs limited to five starts per 2 s started 0.8 s after their claim and
-- the next five 1.2 s after them: ten starts within 2 s.
-- transition: queued -> claimed
WITH clock AS MATERIALIZED (
    -- The claim's one clock, read when it first runs: under the limits lock it
    -- travels in one message with the lock, and statement_timestamp() would be
    -- that message's arrival, before the wait for the lock; now() is the
    -- transaction's start, earlier still. A job enqueued during the wait would
    -- not yet be due, a start stamped that early would leave its rate window
    -- that much early, and a job that fell due during the wait would show a
    -- start before its run_at and a lease short by the wait.
    SELECT clock_timestamp() AS at
), room AS (
    -- How many more jobs of each limited type may start now (no row: unlimited).
    -- Running: the claimed jobs, and those a shutdown handed back or failed while their
    -- handler's thread ran on, until their claimed_until (when that thread stops at the latest).
    SELECT l.type,
           least(
               coalesce(l.max_running - (SELECT count(*) FROM relay.jobs AS r
                                         WHERE r.status = 'claimed' AND r.type = l.type)
                                      - (SELECT count(*) FROM relay.jobs AS r
                                         WHERE r.status <> 'claimed' AND r.type = l.type
                                           AND r.claimed_until > (SELECT at FROM clock)), 2147483647),
               coalesce(l.rate_limit - (SELECT count(*) FROM relay.rate_starts AS s
                                        WHERE s.type = l.type
                                          AND s.started_at > (SELECT at FROM clock)
                                                             - make_interval(secs => l.rate_period_seconds)),
                        2147483647)
           ) AS n
    FROM relay.type_limits AS l
), candidates AS (
    SELECT c.id, c.type, c.priority, c.run_at, c.last_attempt
    -- Each queue once: a name given twice would bring its jobs twice and count them twice.
    FROM (SELECT DISTINCT name FROM unnest(%(queues)s::text[]) AS u(name)
          WHERE name NOT IN (SELECT name FROM relay.queues WHERE paused)
            -- Without the limits lock, claim nothing once any type has a limit.
            AND (%(locked)s OR NOT EXISTS (SELECT 1 FROM relay.type_limits))) AS q
    CROSS JOIN LATERAL (
        SELECT id, type, priority, run_at, attempts >= max_attempts - 1 AS last_attempt FROM relay.jobs
        WHERE queue = q.name AND status = 'queued' AND run_at <= (SELECT at FROM clock)
          AND type NOT IN (SELECT type FROM room WHERE n <= 0)
        ORDER BY priority, run_at, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS c
), chosen AS (
    SELECT id
    FROM (SELECT ranked.id, ranked.priority, ranked.run_at,
                 -- Jobs on their last attempt up to this one, in claim order.
                 count(*) FILTER (WHERE ranked.last_attempt)
                     OVER (ORDER BY ranked.priority, ranked.run_at, ranked.id) AS last_attempts
          FROM (SELECT candidates.*,
                       row_number() OVER (PARTITION BY type ORDER BY priority, run_at, id) AS nth,
                       -- Its place among all the candidates: at most its place in the claim.
                       row_number() OVER (ORDER BY priority, run_at, id) AS place
                FROM candidates) AS ranked
          LEFT JOIN room ON room.type = ranked.type
          WHERE room.n IS NULL OR (ranked.nth <= room.n AND ranked.place <= %(idle_slots)s)) AS ordered
    WHERE last_attempts <= %(last_attempt_room)s
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
), claimed AS (
    UPDATE relay.jobs AS j
    SET status = 'claimed',
        -- Neither may pass the integer's limit: a row written with SQL holding 2147483647 in
        -- either failed every claim of its queue. The token only has to change (fencing); it turns
        -- over to 1, as 0 is the token of a job never claimed.
        attempts = least(j.attempts, 2147483646) + 1,
        lease_token = mod(j.lease_token::bigint, 2147483647)::integer + 1,
        claimed_by = %(worker_id)s,
        claimed_until = (SELECT at FROM clock) + make_interval(secs => %(lease_seconds)s),
        started_at = (SELECT at FROM clock),
        progress = NULL
    FROM chosen
    WHERE j.id = chosen.id AND j.status::text = 'queued'
    -- run_at and created_at within the years a Python datetime holds (1-9999): a
    -- program writing with SQL can store '-infinity' or a year BC, and a row the
    -- worker cannot read would fail the whole claim, again at every worker.
    RETURNING j.id, j.type, j.queue, j.priority, j.payload, j.attempts, j.max_attempts, j.lease_token,
              least(greatest(j.run_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59.999999+00') AS run_at,
              least(greatest(j.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59.999999+00') AS created_at
), rate_logged AS (
    INSERT INTO relay.rate_starts (type, started_at)
    SELECT claimed.type, (SELECT at FROM clock) FROM claimed
    JOIN relay.type_limits AS l ON l.type = claimed.type AND l.rate_limit IS NOT NULL
)
-- In claim order, the order slots take them in: the UPDATE returns rows in
-- whatever order its join met them, and urgent jobs came back behind others.
SELECT * FROM claimed ORDER BY priority, run_at, id;

-- name: job_heartbeat_many
-- Extend the leases a worker still holds. Returns a row per lease still its
-- own: whether it was renewed, and whether an admin asked the job to stop.
-- A row another transaction holds right now (an operator's SELECT ... FOR
-- UPDATE, an admin action inside a longer transaction) is skipped, not waited
-- for: one such wait held up the renewal of every other lease until they ran
-- out, and the sweeper took those jobs from a live worker. The skipped row
-- comes back as still the worker's, not renewed, and is tried again at the
-- next heartbeat (the sweeper skips it too while it is held).
-- The lease runs from when the row is written (clock_timestamp), not from when
-- the statement came (now()): one that waited on a table lock (an index build,
-- a VACUUM FULL, an ALTER TABLE) longer than the lease wrote a lease already
-- run out, and the next sweep took the job from its live worker.
WITH held AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[]) AS held(id, token)
), free_to_renew AS (
    SELECT j.id FROM relay.jobs AS j JOIN held ON held.id = j.id
    WHERE j.lease_token = held.token AND j.status::text = 'claimed'
    FOR NO KEY UPDATE OF j SKIP LOCKED
), renewed AS (
    UPDATE relay.jobs AS j
    SET claimed_until = clock_timestamp() + make_interval(secs => %(lease_seconds)s)
    FROM free_to_renew WHERE j.id = free_to_renew.id
    RETURNING j.id, j.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT id, cancel_requested, true AS renewed FROM renewed
UNION ALL
SELECT j.id, j.cancel_requested_at IS NOT NULL, false
FROM relay.jobs AS j JOIN held ON held.id = j.id
WHERE j.lease_token = held.token AND j.status::text = 'claimed' AND j.id NOT IN (SELECT id FROM renewed);

-- name: job_succeed_in_transaction
-- Record a transactional handler's success in the handler's own transaction,
-- fenced by status and lease token; returns the row when it was still this
-- worker's. Its transaction's now() is when the handler started: finished_at is
-- the statement's time instead. Unlike the completer's statements it waits for
-- a row another session holds: the handler's work commits with it or not at all.
-- transition: claimed -> succeeded
UPDATE relay.jobs AS j
SET status = 'succeeded', finished_at = statement_timestamp(), claimed_until = NULL, result = %(result)s::jsonb
WHERE j.id = %(id)s AND j.lease_token = %(token)s AND j.status::text = 'claimed'
RETURNING j.id, j.status::text AS status;

-- name: job_succeed_many
-- Record successes in one statement, fenced by status and lease token; returns
-- the ids that were still this worker's, with the status written.
-- The completer's four statements (job_succeed_many, job_fail_many,
-- job_snooze_many, job_cancel_running_many) skip a row another session holds
-- locked instead of waiting for it: an operator's SELECT ... FOR UPDATE left
-- open, or any long transaction that touched one job, held up every outcome the
-- worker wrote, and under a lock_timeout or statement_timeout the same batch
-- failed again and again. Such a row comes back with the status 'locked' (no
-- job status), while the fence still holds in the statement's snapshot; the
-- completer writes it again shortly. FOR NO KEY UPDATE is the lock the UPDATE
-- takes anyway, so a foreign key's check (FOR KEY SHARE) from a table of the
-- application is no reason to skip. Locking first costs about 3 us a job.
-- transition: claimed -> succeeded
WITH done AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[], %(results)s::text[]) AS done(id, token, result)
), mine AS (
    SELECT j.id FROM relay.jobs AS j JOIN done ON j.id = done.id AND j.lease_token = done.token
    WHERE j.status::text = 'claimed'
    FOR NO KEY UPDATE OF j SKIP LOCKED
), written AS (
    UPDATE relay.jobs AS j
    SET status = 'succeeded', finished_at = statement_timestamp(), claimed_until = NULL, result = done.result::jsonb
    FROM mine JOIN done ON done.id = mine.id
    WHERE j.id = mine.id AND j.lease_token = done.token AND j.status::text = 'claimed'
    RETURNING j.id, j.status::text AS status
)
SELECT id, status FROM written
UNION ALL
SELECT done.id, 'locked' FROM done
WHERE done.id NOT IN (SELECT id FROM mine)
  AND EXISTS (SELECT FROM relay.jobs AS j
              WHERE j.id = done.id AND j.lease_token = done.token AND j.status::text = 'claimed');

-- name: job_succeeded_with_tokens
-- Which of these (id, lease token) pairs are succeeded with that very token:
-- after a completion whose answer was lost, the successes it wrote. Only the
-- holder of a lease token writes 'succeeded' with it (a new claim changes the
-- token), so a match is the asking worker's own write, not another's.
SELECT j.id, j.status::text AS status
FROM relay.jobs AS j
JOIN unnest(%(ids)s::bigint[], %(tokens)s::integer[]) AS mine(id, token)
  ON j.id = mine.id AND j.lease_token = mine.token
WHERE j.status::text = 'succeeded';

-- name: job_fail_many
-- Record failed attempts, fenced: each job goes back to queued after its backoff
-- delay, or to dead, with the error appended to its history. A job an admin
-- asked to cancel while it ran ends cancelled instead: a failure must not
-- carry the request over to another attempt. A row another session holds
-- comes back 'locked', unwritten (see job_succeed_many).
-- transition: claimed -> queued, dead, cancelled
WITH f AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[], %(next_statuses)s::text[],
                         %(delays)s::float8[], %(runs_on)s::float8[], %(messages)s::text[], %(errors)s::text[])
                  AS f(id, token, next_status, delay_seconds, runs_on, message, error)
    WHERE f.next_status IN ('queued', 'dead')
), mine AS (
    SELECT j.id FROM relay.jobs AS j JOIN f ON j.id = f.id AND j.lease_token = f.token
    WHERE j.status::text = 'claimed'
    FOR NO KEY UPDATE OF j SKIP LOCKED
), written AS (
    UPDATE relay.jobs AS j
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                      ELSE f.next_status END::relay.job_status,
        run_at = CASE WHEN f.next_status = 'queued' AND j.cancel_requested_at IS NULL
                      THEN now() + make_interval(secs => f.delay_seconds) ELSE j.run_at END,
        finished_at = CASE WHEN f.next_status = 'dead' OR j.cancel_requested_at IS NOT NULL THEN now() END,
        -- A job that ends while its handler's thread goes on (a shutdown's overdue handler,
        -- %(runs_on)s seconds more) keeps when that thread stops at the latest: job_requeue waits for
        -- it, and THE CLAIM counts the job as running against its type's limit until then.
        claimed_until = CASE WHEN f.runs_on > 0 THEN now() + make_interval(secs => f.runs_on) END,
        last_error = f.message,
        -- The history keeps the newest 100 attempts, so a job with a huge max_attempts stays small.
        -- A history that is no array (written with SQL by another program) is kept as its first
        -- entry, as admin.get_job reads it (JSON null: none): jsonb_array_length raised on it, and the
        -- refused batch left the job claimed until its lease ran out, then failed every sweep.
        errors = (CASE jsonb_typeof(j.errors)
                      WHEN 'array' THEN CASE WHEN jsonb_array_length(j.errors) >= 100 THEN j.errors - 0 ELSE j.errors END
                      WHEN 'null' THEN '[]'::jsonb
                      ELSE jsonb_build_array(j.errors) END)
                 || jsonb_build_array(f.error::jsonb || jsonb_build_object('at', now()))
    FROM mine JOIN f ON f.id = mine.id
    WHERE j.id = mine.id AND j.lease_token = f.token AND j.status::text = 'claimed'
    RETURNING j.id, j.status::text AS status
)
SELECT id, status FROM written
UNION ALL
SELECT f.id, 'locked' FROM f
WHERE f.id NOT IN (SELECT id FROM mine)
  AND EXISTS (SELECT FROM relay.jobs AS j WHERE j.id = f.id AND j.lease_token = f.token AND j.status::text = 'claimed');

-- name: job_snooze_many
-- Put jobs back to run later without spending an attempt, fenced; a job an
-- admin asked to cancel while it ran ends cancelled instead. A row another
-- session holds comes back 'locked', unwritten (see job_succeed_many).
-- transition: claimed -> queued, cancelled
WITH s AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[], %(delays)s::float8[]) AS s(id, token, delay_seconds)
), mine AS (
    SELECT j.id FROM relay.jobs AS j JOIN s ON j.id = s.id AND j.lease_token = s.token
    WHERE j.status::text = 'claimed'
    FOR NO KEY UPDATE OF j SKIP LOCKED
), written AS (
    UPDATE relay.jobs AS j
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'queued' END::relay.job_status,
        finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL THEN now() END,
        attempts = j.attempts - 1, claimed_until = NULL,
        run_at = CASE WHEN j.cancel_requested_at IS NULL
                      THEN now() + make_interval(secs => s.delay_seconds) ELSE j.run_at END
    FROM mine JOIN s ON s.id = mine.id
    WHERE j.id = mine.id AND j.lease_token = s.token AND j.status::text = 'claimed'
    RETURNING j.id, j.status::text AS status
)
SELECT id, status FROM written
UNION ALL
SELECT s.id, 'locked' FROM s
WHERE s.id NOT IN (SELECT id FROM mine)
  AND EXISTS (SELECT FROM relay.jobs AS j WHERE j.id = s.id AND j.lease_token = s.token AND j.status::text = 'claimed');

-- name: job_hand_back_many
-- Graceful shutdown: return unfinished jobs to the queue, fenced, and give back
-- the attempt the interrupted run used. Each job runs again after its delay:
-- none for a job that never started, a short grace for one whose handler
-- thread was still running (it stops when the worker process exits). A job an
-- admin asked to cancel ends cancelled instead.
-- transition: claimed -> queued, cancelled
UPDATE relay.jobs AS j
SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'queued' END::relay.job_status,
    finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL THEN now() END,
    attempts = greatest(j.attempts - 1, 0),
    -- A job whose thread goes on keeps the grace, as in job_fail_many: THE CLAIM counts it as
    -- running against its type's limit until then (and a requeue of one ended cancelled waits).
    claimed_until = CASE WHEN h.delay_seconds > 0 THEN now() + make_interval(secs => h.delay_seconds) END,
    run_at = now() + make_interval(secs => h.delay_seconds)
FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[], %(delays)s::float8[]) AS h(id, token, delay_seconds)
WHERE j.id = h.id AND j.lease_token = h.token AND j.status::text = 'claimed'
RETURNING j.id;

-- name: job_hand_back_unheld
-- A claim whose answer never reached its worker (the connection broke after
-- the claim committed) left jobs claimed under the worker's id that the worker
-- does not know of: return them, fenced by every lease the worker does hold
-- (id and token), with the attempt they never used. Left to the sweeper, the
-- attempt would count, and a job on its last attempt would end dead without
-- having run. Only for a worker id no other process shares, run by the
-- worker's only claimer between its claims, so no claim of its own is in flight.
-- transition: claimed -> queued, cancelled
UPDATE relay.jobs AS j
SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'queued' END::relay.job_status,
    finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL THEN now() END,
    attempts = greatest(j.attempts - 1, 0), claimed_until = NULL
WHERE j.status = 'claimed' AND j.claimed_by = %(worker_id)s
  AND NOT EXISTS (
      SELECT FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[]) AS held(id, token)
      WHERE held.id = j.id AND held.token = j.lease_token)
RETURNING j.id;

-- name: job_rescue_expired
-- The sweeper, in one statement: jobs whose lease ran out (their worker died or
-- hung) go back to queued, or to dead when their attempts are spent, or to
-- cancelled when an admin had asked them to stop. The outer WHERE re-checks the
-- lease itself, so a heartbeat or completion that won the row first is never
-- overwritten, and several sweepers can run at once.
-- For %(restart_grace)s seconds after the server starts it returns nothing: a
-- lease cannot be renewed while the server is down, so after an outage longer
-- than the lease every lease has run out, the leases of live workers too, and
-- the first sweeper through would start their jobs again (finished ones
-- included, whose outcomes wait to be written). The grace gives the workers
-- that hold them time to renew them (workers pass their lease, at most a
-- minute). A start time ahead of now() (the clock stepped back) grants none.
-- The leases in %(held_ids)s / %(held_tokens)s are the sweeping worker's own,
-- which it renews or ends itself: after an outage longer than the lease, its
-- own sweep ran before its heartbeat and completer got through, and returned
-- jobs whose successes it was about to write, which then ran again.
-- A sweep that waited over %(stall_seconds)s seconds before it could read (a
-- table lock: an index build, a VACUUM FULL, an ALTER TABLE) returns nothing:
-- no lease could be renewed meanwhile either, and the leases that ran out
-- during the wait are those of live workers too, whose renewals, held up by
-- the same lock, are written as it goes (job_heartbeat_many). The next sweep
-- takes those that are still not renewed. A sweep sent late in such a lock
-- (its sweeper was busy with another duty, or its worker started meanwhile)
-- waits less and is not held back: it races the renewals the lock's end lets
-- through, and a row either takes first is skipped by the other (SKIP LOCKED).
-- The wait is told by now(), when the sweep's
-- transaction began: it is one statement, and its transaction begins as the
-- first message of it arrives, before the lock is taken (statement_timestamp()
-- is reset by the later messages of a statement, after the wait).
-- transition: claimed -> queued, dead, cancelled
UPDATE relay.jobs AS j
SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                  WHEN j.attempts >= j.max_attempts THEN 'dead'
                  ELSE 'queued' END::relay.job_status,
    finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL OR j.attempts >= j.max_attempts THEN now() END,
    run_at = now(),
    last_error = 'lease expired: worker ' || j.claimed_by || ' stopped heartbeating',
    -- Kept as job_fail_many keeps it: one history that is no array failed every sweep,
    -- on every worker, and no expired lease anywhere was recovered again.
    errors = (CASE jsonb_typeof(j.errors)
                  WHEN 'array' THEN CASE WHEN jsonb_array_length(j.errors) >= 100 THEN j.errors - 0 ELSE j.errors END
                  WHEN 'null' THEN '[]'::jsonb
                  ELSE jsonb_build_array(j.errors) END)
             || jsonb_build_array(jsonb_build_object(
        'attempt', j.attempts, 'at', now(), 'worker', j.claimed_by,
        'type', 'LeaseExpired',
        'message', 'lease expired: worker ' || j.claimed_by || ' stopped heartbeating',
        'traceback', NULL)),
    claimed_until = NULL
WHERE j.id IN (
    SELECT e.id FROM relay.jobs AS e
    WHERE e.status = 'claimed' AND e.claimed_until < now()
      AND pg_postmaster_start_time() NOT BETWEEN now() - make_interval(secs => %(restart_grace)s) AND now()
      AND clock_timestamp() - now() < make_interval(secs => %(stall_seconds)s)
      AND NOT EXISTS (SELECT FROM unnest(%(held_ids)s::bigint[], %(held_tokens)s::integer[]) AS own(id, token)
                      WHERE own.id = e.id AND own.token = e.lease_token)
    ORDER BY e.claimed_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
  -- The rows the subquery locked, by id: the lease index is its way in, not this one's.
  AND j.status::text = 'claimed' AND j.claimed_until < now()
RETURNING j.id, j.status::text AS status, j.type, j.attempts, j.claimed_by;

-- name: job_lock_for_action
-- Admin: lock one job before acting on it, and read the state the action is
-- chosen from. A worker's write to the row (a retry, a completion, a sweep)
-- that is in flight commits first and is read here, or waits until the action
-- is done (a completion skips the locked row and is written again once it is
-- free, see job_succeed_many); without the lock, a cancel whose job went claimed -> queued between
-- two statements matched neither and was refused though the job was cancellable.
-- The lease token tells whether the job was claimed since a page showed it.
SELECT status::text AS status, cancel_requested_at IS NOT NULL AS cancel_requested, lease_token
FROM relay.jobs WHERE id = %(id)s
FOR UPDATE;

-- name: job_requeue
-- Admin: a dead or cancelled job runs again now with fresh attempts; its error
-- history is kept. One that ended while its handler's thread went on (a
-- shutdown's, which keeps when that thread stops at the latest in
-- claimed_until) runs once that time has passed, never beside the thread. While
-- that time is still ahead the job keeps it, so a cancel and a second requeue
-- before then wait for the thread too.
-- transition: dead -> queued
-- transition: cancelled -> queued
WITH requeued AS (
    UPDATE relay.jobs
    SET status = 'queued', attempts = 0, run_at = greatest(now(), claimed_until), started_at = NULL, finished_at = NULL,
        claimed_by = NULL, claimed_until = CASE WHEN claimed_until > now() THEN claimed_until END,
        cancel_requested_at = NULL, progress = NULL, result = NULL
    WHERE id = %(id)s AND status::text IN ('dead', 'cancelled')
    RETURNING id, queue
)
SELECT id, pg_notify('relay_jobs', queue) AS notified FROM requeued;

-- name: job_cancel
-- Admin: a queued job will not run.
-- transition: queued -> cancelled
UPDATE relay.jobs SET status = 'cancelled', finished_at = now()
WHERE id = %(id)s AND status::text = 'queued'
RETURNING id;

-- name: job_get
-- One job with everything the admin surface shows.
SELECT id, type, queue, priority, payload, status::text AS status, attempts, max_attempts,
       run_at, lease_token, claimed_by, claimed_until, idempotency_key, last_error,
       errors, created_at, started_at, finished_at, cancel_requested_at, progress, result
FROM relay.jobs WHERE id = %(id)s;

-- name: worker_register
-- A worker process records itself when it starts. A worker id used again (one
-- given to Relay.worker(worker_id=...)) is a new start: its row says so, and the
-- time it was down stays a gap (periodic ticks missed in it are told apart by
-- started_at). The returned started_at is this process's registration: its
-- heartbeats and its stop carry it, so an older process with the same id that
-- is still shutting down leaves the new one's row alone.
-- schedules: the types of %(schedule_definitions)s, in their order (sorted by type).
INSERT INTO relay.workers (id, host, pid, queues, concurrency, heartbeat_seconds, schedules, schedule_definitions)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s::text[], %(concurrency)s, %(heartbeat_seconds)s,
        ARRAY(SELECT d.value->>'type' FROM jsonb_array_elements(%(schedule_definitions)s::jsonb)
                                           WITH ORDINALITY AS d(value, n) ORDER BY d.n),
        %(schedule_definitions)s::jsonb)
ON CONFLICT (id) DO UPDATE
SET host = excluded.host, pid = excluded.pid, queues = excluded.queues, concurrency = excluded.concurrency,
    heartbeat_seconds = excluded.heartbeat_seconds, schedules = excluded.schedules,
    schedule_definitions = excluded.schedule_definitions,
    started_at = now(), last_seen_at = now(), stopped_at = NULL, schedules_stopped_at = NULL, in_flight = 0
RETURNING started_at;

-- name: worker_heartbeat
-- A worker is alive and has this many jobs in flight (only while the row is still its registration).
UPDATE relay.workers SET last_seen_at = now(), in_flight = %(in_flight)s
WHERE id = %(id)s AND started_at = %(started_at)s;

-- name: worker_schedules_stop
-- A worker's shutdown began: it checks its schedules no more, though it drains
-- its jobs (only while the row is still its registration).
UPDATE relay.workers SET schedules_stopped_at = now(), last_seen_at = now()
WHERE id = %(id)s AND started_at = %(started_at)s;

-- name: worker_stop
-- A worker shut down gracefully (only while the row is still its registration).
UPDATE relay.workers SET stopped_at = now(), in_flight = 0, last_seen_at = now()
WHERE id = %(id)s AND started_at = %(started_at)s;

-- name: worker_registry_prune
-- Forget workers that stopped, or went quiet without stopping (killed, their
-- machine gone), over %(keep_seconds)s ago: every start of a worker process adds
-- a row, so without this the registry grew with every deploy and restart.
-- Never one relay.worker_state still calls alive (silent for less than two of
-- its heartbeat intervals, however long those are).
DELETE FROM relay.workers
WHERE last_seen_at < now() - make_interval(secs => %(keep_seconds)s)
  AND coalesce(stopped_at, last_seen_at) < now() - make_interval(secs => %(keep_seconds)s)
  AND relay.worker_state(stopped_at, last_seen_at, heartbeat_seconds, %(keep_seconds)s) <> 'alive';

-- name: handler_settings_end_with_transaction
-- Behind a transaction pooler, in a transactional handler's transaction before
-- its success is written: every setting the handler made (SET or SET LOCAL)
-- keeps its value until COMMIT and ends with it, and the role is the worker's
-- again (see sessions.handler_settings_end_with_transaction). RESET ALL returns
-- each setting to its session default, then each is set again for this
-- transaction only. The transaction's own characteristics (isolation, read
-- only) cannot change once it has run a query, and stay as they are; a
-- setting only the handler's role may make is left at its default. A custom
-- setting (myapp.tenant) is cleared: pg_settings does not list them, and left
-- as a plain SET made it, it would reach the pooler's next client.
DO $relay$
DECLARE
    names text[];
    settings text[];
BEGIN
    SELECT coalesce(array_agg(name), '{}'), coalesce(array_agg(current_setting(name)), '{}')
    INTO names, settings
    FROM pg_settings
    WHERE source = 'session'
      AND name NOT IN ('role', 'session_authorization', 'transaction_isolation', 'transaction_read_only',
                       'transaction_deferrable');
    RESET SESSION AUTHORIZATION;
    RESET ROLE;
    RESET ALL;
    FOR i IN 1 .. cardinality(names) LOOP
        BEGIN
            PERFORM set_config(names[i], settings[i], true);
        EXCEPTION WHEN insufficient_privilege OR cant_change_runtime_param THEN
            NULL;
        END;
    END LOOP;
END
$relay$;

-- name: proof_setup
-- `relay prove`: a fresh executions log and no proof jobs left from an earlier run.
-- CREATE SCHEMA IF NOT EXISTS asks for the right to create schemas even when the
-- schema exists: a role that owns relay_proof but may not create schemas was refused.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'relay_proof') THEN
        CREATE SCHEMA relay_proof;
    END IF;
END
$$;
DROP TABLE IF EXISTS relay_proof.executions;
CREATE TABLE relay_proof.executions (
    job_id bigint NOT NULL,
    worker text NOT NULL,
    attempt integer NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);
-- The ids enqueued: a finished job's row may be pruned by retention before the audit.
DROP TABLE IF EXISTS relay_proof.enqueued;
CREATE TABLE relay_proof.enqueued (job_id bigint PRIMARY KEY);
DELETE FROM relay.jobs WHERE queue = 'relay_proof';

-- name: proof_enqueued
-- `relay prove`: record the ids of a batch of proof jobs just enqueued.
INSERT INTO relay_proof.enqueued (job_id) SELECT unnest(%(ids)s::bigint[]);

-- name: proof_record_execution
-- The proof handler's side effect: one row per run, outside the job's completion.
INSERT INTO relay_proof.executions (job_id, worker, attempt) VALUES (%(job_id)s, %(worker)s, %(attempt)s);

-- name: job_types_unhandled_in_default_queue
-- Up to five types of the default queue's waiting or running jobs that no
-- handler in %(handled)s runs: `relay demo` refuses a database holding them.
SELECT DISTINCT type FROM relay.jobs
WHERE queue = 'default' AND status IN ('queued', 'claimed') AND type <> ALL(%(handled)s::text[])
ORDER BY type LIMIT 5;

-- name: proof_duplicates
-- The audit: jobs that ran more than once.
SELECT job_id, count(*) FROM relay_proof.executions GROUP BY job_id HAVING count(*) > 1;

-- name: proof_outcome
-- The audit of every job enqueued: succeeded (it ran, by its execution row, and
-- its row says so, or retention pruned it after it ran), lost (it ended dead or
-- cancelled, or succeeded or gone without its having run), or unfinished (still
-- queued or claimed). A job marked succeeded with no execution counted as a
-- success: a queue that ended jobs without running them passed the proof.
SELECT count(*) FILTER (WHERE ran.job_id IS NOT NULL AND (j.status = 'succeeded' OR j.id IS NULL)) AS succeeded,
       count(*) FILTER (WHERE j.id IS NULL AND ran.job_id IS NOT NULL) AS pruned,
       count(*) FILTER (WHERE j.status IN ('dead', 'cancelled')
                           OR (ran.job_id IS NULL AND (j.status = 'succeeded' OR j.id IS NULL))) AS lost,
       count(*) FILTER (WHERE j.status IN ('queued', 'claimed')) AS unfinished
FROM relay_proof.enqueued AS e
LEFT JOIN relay.jobs AS j ON j.id = e.job_id
LEFT JOIN (SELECT DISTINCT job_id FROM relay_proof.executions) AS ran ON ran.job_id = e.job_id;

-- name: proof_remove_unfinished
-- `relay prove`, its workers gone: the proof jobs it had no time for, which nothing else would run.
DELETE FROM relay.jobs WHERE queue = 'relay_proof' AND status IN ('queued', 'claimed');

-- name: proof_progress
-- How many proof jobs are finished and how many succeeded.
SELECT count(*) FILTER (WHERE status IN ('succeeded', 'dead', 'cancelled')) AS finished,
       count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
       count(*) AS total
FROM relay.jobs WHERE queue = 'relay_proof';
