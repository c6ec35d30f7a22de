-- Counters for the admin surface, so /queues, /stats and /metrics never count
-- the jobs table.
--
-- Choices weighed, measured on the 2-core development machine (PostgreSQL 15):
--  * count(*) over relay.jobs: exact, but it reads the whole table: 118-127 ms
--    (median, warm cache) for 1,000,000 rows, growing with the table, on every
--    dashboard refresh and every Prometheus scrape.
--  * planner estimates (pg_class.reltuples, pg_stats): free, but "3 dead jobs"
--    is exactly the number an on-call engineer acts on, and estimates cannot
--    say it.
--  * per-(queue, state) counter rows updated in place by row triggers: exact,
--    but every enqueue, claim and completion would lock one of a handful of
--    rows until its transaction ends, and an enqueue inside a user's slow
--    request would stall every other enqueue and claim on that queue.
--  * chosen: append-only deltas written by statement-level triggers (one small
--    INSERT per statement, whatever the batch size), folded by readers. Exact,
--    no lock shared between writers. Cost on the hot path, measured with
--    triggers enabled vs disabled on the same database, three rounds each:
--    single-job enqueue 1920/1941/1923 vs 2017/2130/1810 jobs/s (about -3%),
--    enqueue_many 60390/57482/63034 vs 56951/60760/56167 jobs/s (no
--    difference), drain with one 8-slot worker 6495/6692/5365 vs
--    7263/7129/5225 jobs/s (about -5%, within this machine's noise); per
--    statement inside one transaction a single-row claim-style UPDATE costs
--    11 us with the trigger against 2 us without.
--    Reads with 1,000,000 jobs (bench/web_latency.py): /api/admin/queues p95
--    2.8 ms, /stats 3.0 ms, /workers 2.2 ms, /metrics 5.2 ms, folding the 2,000
--    deltas of 2,000 single enqueues included. The weak spot: deltas pile up
--    while nobody reads (one per write statement); folding 1,000,000 of them
--    takes 1.7 s once. Prometheus scraping every 15 s, or a worker calling
--    relay_core.monitor.fold_counters on a timer, keeps them to a few thousand.

-- How many jobs each (queue, state) holds, as deltas. Statement-level triggers
-- on relay.jobs append one row per (queue, state) a statement changed; nobody
-- updates a row in place, so an enqueue inside a user's long transaction never
-- blocks another enqueue, a claim or a completion. A reader sums the rows: the
-- sum is exact for the reader's snapshot, because deltas commit or roll back
-- with the job rows they describe.
CREATE TABLE relay.job_counts (
    queue text NOT NULL,
    state relay.job_status NOT NULL,
    n     bigint NOT NULL
) WITH (
    -- Rows are appended and later folded (deleted and re-inserted as one sum).
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- Attempts finished per minute, per queue and type, as deltas in the same way.
-- succeeded: claimed -> succeeded. failed: claimed -> queued or dead with the
-- attempt kept (an error or an expired lease; snoozes and hand-backs give the
-- attempt back and are not failures). dead: claimed -> dead. Minutes older than
-- an hour are folded into one '-infinity' row per (queue, type), so the table
-- keeps the last hour per minute plus all-time totals for Prometheus counters.
CREATE TABLE relay.job_outcomes (
    minute    timestamptz NOT NULL,
    queue     text NOT NULL,
    type      text NOT NULL,
    succeeded bigint NOT NULL DEFAULT 0,
    failed    bigint NOT NULL DEFAULT 0,
    dead      bigint NOT NULL DEFAULT 0
) WITH (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- The per-minute read of /stats looks at the last hour only.
CREATE INDEX job_outcomes_minute_idx ON relay.job_outcomes (minute);

CREATE FUNCTION relay.jobs_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, status, count(*) FROM inserted_jobs GROUP BY queue, status;
    RETURN NULL;
END
$$;

CREATE FUNCTION relay.jobs_counted_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Heartbeats and other updates that move no job net to zero and write nothing.
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, state, sum(n) FROM (
        SELECT queue, status AS state, -1 AS n FROM old_jobs
        UNION ALL
        SELECT queue, status, 1 FROM new_jobs
    ) AS moves
    GROUP BY queue, state
    HAVING sum(n) <> 0;

    INSERT INTO relay.job_outcomes (minute, queue, type, succeeded, failed, dead)
    SELECT date_trunc('minute', now()), n.queue, n.type,
           count(*) FILTER (WHERE n.status = 'succeeded'),
           count(*) FILTER (WHERE n.status IN ('queued', 'dead') AND n.attempts >= o.attempts),
           count(*) FILTER (WHERE n.status = 'dead')
    FROM new_jobs AS n JOIN old_jobs AS o ON o.id = n.id
    WHERE o.status = 'claimed' AND n.status <> 'claimed'
    GROUP BY n.queue, n.type;
    RETURN NULL;
END
$$;

CREATE FUNCTION relay.jobs_counted_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, status, -count(*) FROM deleted_jobs GROUP BY queue, status;
    RETURN NULL;
END
$$;

CREATE FUNCTION relay.jobs_counted_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM relay.job_counts;
    RETURN NULL;
END
$$;

-- CREATE TRIGGER takes a lock that blocks writes to relay.jobs until this
-- migration commits, so the initial count below and the triggers agree.
CREATE TRIGGER jobs_counted_insert AFTER INSERT ON relay.jobs
    REFERENCING NEW TABLE AS inserted_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION relay.jobs_counted_insert();
CREATE TRIGGER jobs_counted_update AFTER UPDATE ON relay.jobs
    REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION relay.jobs_counted_update();
CREATE TRIGGER jobs_counted_delete AFTER DELETE ON relay.jobs
    REFERENCING OLD TABLE AS deleted_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION relay.jobs_counted_delete();
CREATE TRIGGER jobs_counted_truncate AFTER TRUNCATE ON relay.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION relay.jobs_counted_truncate();

-- The one full count Relay ever makes: the jobs that exist before the triggers.
INSERT INTO relay.job_counts (queue, state, n)
SELECT queue, status, count(*) FROM relay.jobs GROUP BY queue, status;
