-- Statements for operating Relay: paused queues, type limits, schedules,
-- retention, cancellation of running jobs, progress. Same format as queries.sql.
-- Jobs found by id compare status as text: see the note in queries.sql.

-- name: claim_limits_lock
-- Claims that may hit a type limit serialise on one advisory lock, taken in the
-- claim's transaction before the claim statement, so that statement's snapshot
-- sees every earlier claim. Taken whether or not this statement's snapshot sees
-- a limit: one that committed just after it would be enforced by the claim's
-- later snapshot, by two claims at once, neither holding the lock. (Every
-- advisory-lock key Relay takes is listed at relay_core.migrate.MIGRATION_LOCK_KEY.)
SELECT pg_advisory_xact_lock(7265108723);

-- name: claim_time_limit
-- Behind a transaction pooler, each statement of the claim's transaction ends
-- within %(ms)s milliseconds on the server (statement_timeout, till COMMIT; a
-- message of several statements times each one): no cancel is sent there at
-- a stop, and a claim whose connection was cut ran on, waiting for a lock,
-- and claimed after its worker had exited (see claim.POOLED_CLAIM_STATEMENT_SECONDS).
SELECT set_config('statement_timeout', %(ms)s, true);

-- name: session_read_only_source
-- Whether the server is in recovery (a standby), whether this session's
-- default_transaction_read_only is on, and where that comes from (client,
-- user, database user: the connection's own settings; database,
-- configuration file: the server's).
SELECT pg_is_in_recovery(), setting = 'on', source FROM pg_settings WHERE name = 'default_transaction_read_only';

-- name: session_server_keepalives
-- The server's keepalives on this session, where the server's configuration
-- leaves them to the operating system's defaults (source 'default'): a client
-- whose host died or whose network path went silent while its transaction was
-- open kept the transaction, and its locks, for the two hours before the
-- first keepalive probe. Ignored on Unix-socket sessions.
SELECT count(set_config(s.name, v.setting, false))
FROM (VALUES ('tcp_keepalives_idle', %(keepalives_idle)s::text),
             ('tcp_keepalives_interval', %(keepalives_interval)s::text),
             ('tcp_keepalives_count', %(keepalives_count)s::text)) AS v(name, setting)
JOIN pg_settings AS s ON s.name = v.name
WHERE s.source = 'default';

-- name: type_limits_exist
-- Whether any job type has a limit (workers check each second to pick the claim's path).
SELECT EXISTS (SELECT 1 FROM relay.type_limits);

-- name: periodic_check
-- A worker's check each second: whether any job type has a limit (to pick the
-- claim's path), and how long until the database clock's next whole second,
-- when the next check is due (cron ticks fall on the database's whole seconds).
SELECT EXISTS (SELECT 1 FROM relay.type_limits) AS limits_exist,
       (1 - mod(extract(epoch FROM clock_timestamp())::numeric, 1))::float8 AS until_next_second;

-- name: queue_set_paused
-- Pause or resume a queue; workers skip paused queues at their next claim.
INSERT INTO relay.queues (name, paused, paused_at, updated_at)
VALUES (%(name)s, %(paused)s, CASE WHEN %(paused)s THEN now() END, now())
ON CONFLICT (name) DO UPDATE
SET paused = excluded.paused, paused_at = excluded.paused_at, updated_at = now()
RETURNING name, paused, paused_at;

-- name: queue_paused_list
-- Queues that are paused now.
SELECT name, paused_at FROM relay.queues WHERE paused ORDER BY name;

-- name: queue_paused_holding_dead
-- The paused queues that hold dead jobs of a type: those a requeue of them all
-- sends to wait until the queue is resumed.
SELECT q.name FROM relay.queues AS q
WHERE q.paused
  AND EXISTS (SELECT 1 FROM relay.jobs AS j WHERE j.status = 'dead' AND j.type = %(type)s AND j.queue = q.name)
ORDER BY q.name;

-- name: type_limit_upsert
-- A worker publishes the limits its handler declares for a type, as their publisher.
INSERT INTO relay.type_limits (type, max_running, rate_limit, rate_period_seconds, updated_at, published_by)
VALUES (%(type)s, %(max_running)s, %(rate_limit)s, %(rate_period_seconds)s, now(), %(published_by)s)
ON CONFLICT (type) DO UPDATE
SET max_running = excluded.max_running, rate_limit = excluded.rate_limit,
    rate_period_seconds = excluded.rate_period_seconds, updated_at = now(), published_by = excluded.published_by
WHERE (relay.type_limits.max_running, relay.type_limits.rate_limit, relay.type_limits.rate_period_seconds,
       relay.type_limits.published_by)
      IS DISTINCT FROM (excluded.max_running, excluded.rate_limit, excluded.rate_period_seconds,
                        excluded.published_by);

-- name: type_limit_insert_unless_published
-- A worker's check publishes the limits of a type that had none when it read
-- (type_limits_held): unless another worker has published some since (a new
-- release's, at its start), which it keeps.
INSERT INTO relay.type_limits (type, max_running, rate_limit, rate_period_seconds, updated_at, published_by)
VALUES (%(type)s, %(max_running)s, %(rate_limit)s, %(rate_period_seconds)s, now(), %(published_by)s)
ON CONFLICT (type) DO NOTHING;

-- name: type_limit_update_as_read
-- A worker's check writes its limits over a type's row only as it read it
-- (type_limits_held; %(seen_by)s: its publisher then). A new release's worker
-- that published meanwhile, or removed the row, was written over by an old
-- one's check, and then left the row to that live publisher for as long as it
-- ran.
UPDATE relay.type_limits
SET max_running = %(max_running)s, rate_limit = %(rate_limit)s, rate_period_seconds = %(rate_period_seconds)s,
    updated_at = now(), published_by = %(published_by)s
WHERE type = %(type)s AND published_by IS NOT DISTINCT FROM %(seen_by)s;

-- name: type_limit_delete
-- A worker's handler for a type declares no limits any more.
DELETE FROM relay.type_limits WHERE type = %(type)s;

-- name: type_limit_delete_as_read
-- A worker's check removes a type's limits only as it read them (as in type_limit_update_as_read).
DELETE FROM relay.type_limits WHERE type = %(type)s AND published_by IS NOT DISTINCT FROM %(seen_by)s;

-- name: set_lock_timeout
-- Bound every lock wait for the rest of the transaction (a duration as text, '1s').
SELECT set_config('lock_timeout', %(timeout)s, true);

-- name: type_limits_held
-- The limits published for each type a worker has a handler for (published:
-- whether a row exists), whether they name this worker as their publisher,
-- and whether another live worker holds them (their publisher, alive by
-- relay.worker_state and its bound). The worker publishes its own where no
-- other live worker holds them and they differ from its own or name another
-- (type_limit_upsert, or type_limit_delete where its handler declares none):
-- a row whose publisher is alive is left to it, so two releases running side
-- by side in a deploy do not overwrite each other's at every check. A row that
-- names this worker but holds other values was written over by a release
-- before migration 0024, whose upsert left published_by as it was.
SELECT t.type, l.type IS NOT NULL AS published, l.max_running, l.rate_limit, l.rate_period_seconds,
       l.published_by, l.published_by IS NOT DISTINCT FROM %(worker_id)s AS mine,
       EXISTS (
           SELECT FROM relay.workers AS w
           WHERE w.id = l.published_by AND w.id <> %(worker_id)s
             AND relay.worker_state(w.stopped_at, w.last_seen_at, w.heartbeat_seconds, 60) = 'alive'
       ) AS held_by_another
FROM unnest(%(types)s::text[]) AS t(type)
LEFT JOIN relay.type_limits AS l ON l.type = t.type
ORDER BY t.type;

-- name: job_type_upsert
-- A worker publishes the max_attempts its handler declares for a type.
INSERT INTO relay.job_types (type, max_attempts, updated_at)
VALUES (%(type)s, %(max_attempts)s, now())
ON CONFLICT (type) DO UPDATE
SET max_attempts = excluded.max_attempts, updated_at = now()
WHERE relay.job_types.max_attempts IS DISTINCT FROM excluded.max_attempts;

-- name: type_limit_list
-- Every declared limit with the jobs of that type running now, counted as THE
-- CLAIM counts them: the claimed ones, and those a shutdown handed back or
-- failed while their handler's thread ran on, until their claimed_until.
SELECT l.type, l.max_running, l.rate_limit, l.rate_period_seconds,
       (SELECT count(*) FROM relay.jobs r WHERE r.status = 'claimed' AND r.type = l.type)
       + (SELECT count(*) FROM relay.jobs r
          WHERE r.status <> 'claimed' AND r.type = l.type AND r.claimed_until > now()) AS running
FROM relay.type_limits l ORDER BY l.type;

-- name: rate_starts_prune
-- Forget each type's starts older than its own rate window (all of them for a
-- type with no rate limit now). Trimmed to the longest window of any type, a
-- type limited per second kept a month of starts beside one limited per month.
DELETE FROM relay.rate_starts s
WHERE s.started_at < now() - make_interval(secs => coalesce(
    (SELECT l.rate_period_seconds FROM relay.type_limits l WHERE l.type = s.type), 0));

-- name: schedule_upsert
-- A worker publishes a periodic schedule; one whose cron expression or time zone changed
-- starts from now (a new queue alone keeps the ticks where they were).
INSERT INTO relay.schedules (type, cron, timezone, queue, last_tick, next_tick, updated_at, published_by)
VALUES (%(type)s, %(cron)s, %(timezone)s, %(queue)s, %(last_tick)s, %(next_tick)s, now(), %(published_by)s)
ON CONFLICT (type) DO UPDATE
SET cron = excluded.cron, timezone = excluded.timezone, queue = excluded.queue, published_by = excluded.published_by,
    last_tick = CASE WHEN (relay.schedules.cron, relay.schedules.timezone) = (excluded.cron, excluded.timezone)
                     THEN relay.schedules.last_tick ELSE excluded.last_tick END,
    next_tick = CASE WHEN (relay.schedules.cron, relay.schedules.timezone) = (excluded.cron, excluded.timezone)
                     THEN relay.schedules.next_tick ELSE excluded.next_tick END,
    updated_at = now()
RETURNING type, cron, timezone, queue, last_tick, next_tick;

-- name: schedule_advance
-- Claim one tick of a schedule: only the worker whose UPDATE moves last_tick
-- forward enqueues it (in the same transaction). Returns the tick it moved on
-- from, so the ticks passed in between can be told: read FOR UPDATE, so the
-- latest committed tick, not the snapshot's. SKIP LOCKED: a row another
-- transaction holds (a worker enqueuing this tick, an operator's open
-- transaction) is skipped until the next check (won is false), rather than
-- waited for with every other maintenance duty of the worker (the sweeper
-- among them) behind it. Only a worker whose schedule is the one published
-- (cron, time zone, queue) may advance it: in a rolling deploy that changes a
-- schedule, the old workers still running would otherwise enqueue the old
-- expression's ticks beside the new one's. Nor do they lock the row: every
-- worker checks at the same moment of each second, and the new workers
-- skipped a row the old ones held just to read it, so an every-second
-- schedule lost about a third of its ticks for as long as the deploy
-- overlapped. Returns what was published, and whether another worker still
-- checks it (alive by relay.worker_state, with RELAY_WORKER_STALE_SECONDS'
-- default, and not shutting down): the one that published it, or any that
-- registered the published schedule as its own (migration 0025), for the
-- others: a schedule nobody checks any more is theirs to take over. Asking
-- the publisher alone, a new release's worker that published a changed
-- schedule and then stopped handed it to the old release's workers while
-- the new release's others still ran it. A worker
-- named as the publisher of a schedule not its own did not publish it: a
-- Relay older than migration 0021, restarted mid-deploy, wrote its schedule
-- back and left published_by as it was, and that worker left the ticks to
-- itself for as long as it ran. The registry is read only for a schedule
-- published differently (NULL otherwise): it holds every worker of the last
-- days, each killed one's schedules matched as JSON, and read on every
-- check of every schedule, 8,000 rows took a second, an every-second
-- schedule's whole slot. Returns the last tick as the snapshot read it too,
-- for a worker that did not advance it to tell one later than now. No row:
-- the schedule is not in relay.schedules (deleted by hand).
WITH published AS (
    SELECT s.type, s.cron, s.timezone, s.queue, s.last_tick,
           (s.cron, s.timezone, s.queue) = (%(cron)s, %(timezone)s, %(queue)s) AS current,
           CASE WHEN (s.cron, s.timezone, s.queue) <> (%(cron)s, %(timezone)s, %(queue)s) THEN EXISTS (
               SELECT FROM relay.workers w
               WHERE (w.id = s.published_by
                      OR w.schedule_definitions @> jsonb_build_array(jsonb_build_object(
                             'type', s.type, 'cron', s.cron, 'timezone', s.timezone, 'queue', s.queue)))
                 AND w.id IS DISTINCT FROM %(worker_id)s
                 AND relay.worker_state(w.stopped_at, w.last_seen_at, w.heartbeat_seconds, 60) = 'alive'
                 AND (w.schedules_stopped_at IS NULL OR w.schedules_stopped_at < w.started_at)
           ) END AS publisher_checks
    FROM relay.schedules s WHERE s.type = %(type)s
), held AS (
    SELECT s.type, s.last_tick
    FROM relay.schedules s
    WHERE s.type = %(type)s AND (s.cron, s.timezone, s.queue) = (%(cron)s, %(timezone)s, %(queue)s)
    FOR UPDATE OF s SKIP LOCKED
), advanced AS (
    UPDATE relay.schedules AS s
    SET last_tick = %(tick)s, next_tick = %(next_tick)s, updated_at = now()
    FROM held
    WHERE s.type = held.type AND (s.last_tick IS NULL OR s.last_tick < %(tick)s)
    RETURNING held.last_tick AS previous_tick
)
SELECT EXISTS (SELECT FROM advanced) AS won, (SELECT previous_tick FROM advanced) AS previous_tick,
       published.current, published.publisher_checks, published.last_tick AS seen_last_tick,
       published.cron, published.timezone, published.queue
FROM published;

-- name: schedule_take_over_lock
-- The row of a schedule its publisher no longer checks, for the worker about to
-- publish its own: skipped when another transaction holds it (a worker taking it
-- over too, an operator's open transaction), as schedule_advance skips it, so
-- no maintenance duty waits behind it; the next check tries again.
SELECT type FROM relay.schedules WHERE type = %(type)s FOR UPDATE SKIP LOCKED;

-- name: schedule_record_run
-- The tick just enqueued is the schedule's last run, written in the transaction
-- that inserted its job (last_tick also moves for ticks that enqueue nothing).
-- The job is read back by its key, so a tick whose job already existed points at it.
UPDATE relay.schedules
SET last_enqueued_tick = %(tick)s,
    last_job_id = (SELECT id FROM relay.jobs WHERE idempotency_key = %(idempotency_key)s)
WHERE type = %(type)s;

-- name: worker_was_running_at
-- Whether a worker serving the queue and checking the schedule was running at
-- a moment: it registered before it and was heard from after it (heartbeats
-- come from their own thread, so a worker whose maintenance was held up still
-- counts), or within two of its heartbeat intervals before it, as the admin
-- surface counts a worker alive: heartbeats come every lease / 3, so with a
-- long lease a running worker may not have been heard from since the moment
-- (nor, after an outage, since the database came back); bounded as
-- relay.worker_state bounds it (migration 0019). A worker without the
-- schedule (a deploy that had removed it) never saw its tick; one registered
-- by an older Relay records no schedules and counts by its queues (migration
-- 0017). A worker draining its jobs on the way
-- out no longer checks (migration 0018); a stop time older than the
-- registration is an earlier one's, left by a release that did not clear it.
SELECT EXISTS (
    SELECT 1 FROM relay.workers
    WHERE %(queue)s = ANY(queues) AND (schedules IS NULL OR %(type)s = ANY(schedules))
      AND started_at <= %(at)s
      AND last_seen_at >= %(at)s - make_interval(secs => least(2 * coalesce(heartbeat_seconds, 0), 1e8))
      AND (stopped_at IS NULL OR stopped_at >= %(at)s)
      AND (schedules_stopped_at IS NULL OR schedules_stopped_at < started_at OR schedules_stopped_at >= %(at)s)
) AS running;

-- name: schedule_list
-- Every schedule with its next run and its last run: the tick that last enqueued
-- a job, and that job's status now (NULL once retention deleted it). checked:
-- whether a live worker checks it now; a schedule whose handler is gone from every
-- worker stays listed, after the checked ones, and its next_tick is when it
-- would have run.
SELECT s.type, s.cron, s.timezone, s.queue, s.last_tick, s.next_tick,
       s.last_enqueued_tick, s.last_job_id, j.status::text AS last_job_status, s.runs_recorded_since,
       EXISTS (
           SELECT FROM relay.workers w
           -- Every worker checks all its handlers' schedules, whatever queues it serves; one
           -- registered by a Relay before migration 0017 records none and counts by its queues.
           WHERE (s.type = ANY(w.schedules) OR (w.schedules IS NULL AND s.queue = ANY(w.queues)))
             AND relay.worker_state(w.stopped_at, w.last_seen_at, w.heartbeat_seconds, 60) = 'alive'
             AND (w.schedules_stopped_at IS NULL OR w.schedules_stopped_at < w.started_at)
       ) AS checked
FROM relay.schedules s LEFT JOIN relay.jobs j ON j.id = s.last_job_id
ORDER BY checked DESC, s.next_tick NULLS LAST, s.type;

-- name: db_now
-- The database clock; every decision about time uses it.
SELECT now();

-- name: tick_begin
-- The first statement of a schedule's tick: the database clock, and how long
-- the tick's transaction may sit idle between its statements (milliseconds,
-- as text) before the server ends its session. The tick locks the schedule's
-- row, which every other worker skips while it is held, so a worker frozen
-- mid-tick (SIGSTOP, a paused container, whose kernel still answers
-- keepalives) stopped the schedule on every worker for as long as it was
-- frozen, and its ticks were lost.
SELECT now(), set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true);

-- name: job_prune_finished
-- Retention: delete up to %(limit)s finished jobs of one status older than the
-- cutoff, those that finished first first, skipping rows anyone holds. It reads
-- jobs_finished_idx (migration 0013), so it never reads the jobs it keeps.
-- Per-minute history lives in relay.job_outcomes and is not touched.
DELETE FROM relay.jobs
WHERE id IN (
    SELECT id FROM relay.jobs
    WHERE status = %(status)s::relay.job_status
      AND finished_at < now() - make_interval(secs => %(older_than_seconds)s)
    ORDER BY finished_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
RETURNING id;

-- name: job_request_cancel
-- Admin: ask a running job to stop; its worker sees it at the next heartbeat.
UPDATE relay.jobs SET cancel_requested_at = now()
WHERE id = %(id)s AND status::text = 'claimed' AND cancel_requested_at IS NULL
RETURNING id;

-- name: job_cancel_running_many
-- A handler stopped after cancellation was requested: the job ends cancelled, fenced.
-- A job cancelled while it waited in its worker for a slot (%(unstarted)s) never
-- ran: it gets back the attempt its claim counted, as a hand-back gives it back.
-- A row another session holds comes back 'locked', unwritten (see job_succeed_many).
-- transition: claimed -> cancelled
WITH c AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::integer[], %(unstarted)s::boolean[]) AS c(id, token, unstarted)
), mine AS (
    SELECT j.id FROM relay.jobs AS j JOIN c ON j.id = c.id AND j.lease_token = c.token
    WHERE j.status::text = 'claimed'
    FOR NO KEY UPDATE OF j SKIP LOCKED
), written AS (
    UPDATE relay.jobs AS j
    SET status = 'cancelled', finished_at = now(), claimed_until = NULL,
        attempts = CASE WHEN c.unstarted THEN greatest(j.attempts - 1, 0) ELSE j.attempts END
    FROM mine JOIN c ON c.id = mine.id
    WHERE j.id = mine.id AND j.lease_token = c.token AND j.status::text = 'claimed'
    RETURNING j.id, j.status::text AS status
)
SELECT id, status FROM written
UNION ALL
SELECT c.id, 'locked' FROM c
WHERE c.id NOT IN (SELECT id FROM mine)
  AND EXISTS (SELECT FROM relay.jobs AS j WHERE j.id = c.id AND j.lease_token = c.token AND j.status::text = 'claimed');

-- name: job_set_progress
-- A running handler reports progress, fenced by its lease, and renews the lease
-- as a heartbeat would: the report holds the row until it commits, and the
-- heartbeat skips a held row, so reports sent back to back left no heartbeat
-- a chance and the lease ran out under a live worker. Whether an admin asked
-- the job to stop comes back too, for the same reason. The lease runs from
-- when the row is written, as a heartbeat's does (job_heartbeat_many).
UPDATE relay.jobs
SET progress = %(progress)s::jsonb,
    claimed_until = greatest(claimed_until, clock_timestamp() + make_interval(secs => %(lease_seconds)s))
WHERE id = %(id)s AND lease_token = %(token)s AND status::text = 'claimed'
RETURNING id, cancel_requested_at IS NOT NULL AS cancel_requested;

-- name: tables_needing_vacuum
-- Relay's tables autovacuum would vacuum now but will not: it is off for the
-- whole server, or for that table. The trigger is autovacuum's own rule
-- (dead rows over a threshold plus a fraction of the live rows). may_vacuum:
-- whether this session's role may VACUUM the table (a superuser, a member of
-- the table's or the database's owner role, or from PostgreSQL 17 a holder of
-- MAINTAIN); for any other role VACUUM only warns and skips the table. A table
-- vacuumed less than a naptime ago waits, as it would for autovacuum.
SELECT s.relname,
       pg_has_role(c.relowner, 'USAGE')
       OR pg_has_role((SELECT datdba FROM pg_database WHERE datname = current_database()), 'USAGE')
       OR CASE WHEN current_setting('server_version_num')::int >= 170000
               THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END AS may_vacuum
FROM pg_stat_user_tables AS s
JOIN pg_class AS c ON c.oid = s.relid
WHERE s.schemaname = 'relay'
  AND (NOT current_setting('autovacuum')::boolean
       OR EXISTS (SELECT 1 FROM pg_options_to_table(c.reloptions) AS o  -- any spelling: off, false, no, 0
                  WHERE o.option_name = 'autovacuum_enabled' AND NOT o.option_value::boolean))
  AND s.n_dead_tup > %(threshold)s + %(scale_factor)s * s.n_live_tup
  AND greatest(s.last_vacuum, s.last_autovacuum, '-infinity')
      < now() - make_interval(secs => %(naptime)s)
ORDER BY s.n_dead_tup DESC;
