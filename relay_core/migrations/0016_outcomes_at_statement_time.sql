-- Two corrections to the counters of migration 0003.
--
-- A transactional handler's success is written by its own transaction, which
-- began when the handler started: now() there is the start, so a success was
-- counted in relay.job_outcomes in the minute its handler started (one that
-- ran over an hour never showed in the per-minute history) and job_succeed_many
-- stamped finished_at with the start too, so retention could prune the job a
-- handler's run time early. Both now read statement_timestamp(): the moment
-- the finishing statement ran, which outside such a transaction is now().
--
-- TRUNCATE relay.jobs emptied relay.job_counts with a DELETE, which sees only
-- what its snapshot sees: a fold that committed while the TRUNCATE waited for
-- it, or a delta committed after a REPEATABLE READ snapshot, survived, and
-- the counters showed jobs that no longer existed. The trigger now truncates
-- the counters too (its lock waits for a fold in progress; what it removes
-- does not depend on a snapshot), unless the same statement truncates them.
-- relay.job_outcomes is history and is kept.
CREATE OR REPLACE FUNCTION relay.jobs_counted_update() RETURNS trigger LANGUAGE plpgsql AS $$
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
    SELECT date_trunc('minute', statement_timestamp()), n.queue, n.type,
           count(*) FILTER (WHERE n.status = 'succeeded'),
           count(*) FILTER (WHERE (n.status IN ('queued', 'dead') AND n.attempts >= o.attempts)
                                  OR (n.status = 'cancelled' AND n.errors <> o.errors)),
           count(*) FILTER (WHERE n.status = 'dead')
    FROM new_jobs AS n JOIN old_jobs AS o ON o.id = n.id
    WHERE o.status = 'claimed' AND n.status <> 'claimed'
    GROUP BY n.queue, n.type;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION relay.jobs_counted_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE relay.job_counts;
    RETURN NULL;
EXCEPTION WHEN object_in_use THEN
    -- The same statement truncates relay.job_counts too (TRUNCATE relay.jobs,
    -- relay.job_counts): it is empty already.
    RETURN NULL;
END
$$;
