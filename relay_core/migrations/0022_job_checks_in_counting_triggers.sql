-- The rules relay.jobs' four CHECK constraints held are now enforced by the
-- counting triggers, which read every inserted and updated row anyway.
--
-- Why: PostgreSQL 15 reads and plans a table's CHECK expressions anew for
-- every INSERT and UPDATE statement, whatever it writes; a trigger's queries
-- are planned once per session. Server CPU per one-job insert
-- (`synchronous_commit` off, 5,000 prepared inserts, five interleaved rounds,
-- medians, on copies of relay.jobs): 166 us with the CHECKs and the old
-- trigger, 152 us with the rules inside the trigger's one aggregate, 118 us
-- with neither; a one-job claim-style UPDATE 187 against 167 us. Every
-- UPDATE statement on relay.jobs skips the CHECKs' planning the same way.
--
-- What is refused is unchanged, and so is how: SQLSTATE 23514
-- (check_violation), naming the same constraint (the first by name, as
-- PostgreSQL orders CHECKs, when a row breaks several), for a row inserted
-- or updated by hand or by Relay. The differences:
--  * the rules are checked once the statement has written its rows, so an
--    error raised while writing them (a NOT NULL column, a taken
--    idempotency key, a failed cast in a later row) now comes first;
--  * a row an INSERT ... ON CONFLICT skipped (DO NOTHING) or replaced by an
--    update (DO UPDATE: the updated row is checked) is not checked, since it
--    was never written;
--  * the error's DETAIL names the failing row's id rather than every column;
--  * the triggers enforce the rules, so they must stay enabled (they also
--    keep the admin counters, which are wrong without them).
--
-- The DROP takes the table's exclusive lock first; the functions need none.
ALTER TABLE relay.jobs
    DROP CONSTRAINT jobs_type_check,
    DROP CONSTRAINT jobs_max_attempts_check,
    DROP CONSTRAINT jobs_queue_format,
    DROP CONSTRAINT jobs_claim_has_lease;

-- The rule a job row breaks, by the name of the constraint that held it, or
-- NULL; of several, the first by name, as PostgreSQL checked them. One SQL
-- expression, so the planner inlines it into the triggers' queries; a
-- BEGIN ATOMIC body (PostgreSQL 14) is bound to its functions and operators
-- when it is created, as a CHECK was, so no session's search_path can swap
-- them. The default queue, which every job not given one uses, passes by an
-- equality test before the regular expression runs (migration 0006).
CREATE FUNCTION relay.job_rule_broken(
    type text, queue text, max_attempts integer, status relay.job_status, claimed_by text, claimed_until timestamptz
) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
BEGIN ATOMIC
    SELECT CASE
        WHEN status = 'claimed' AND (claimed_by IS NULL OR claimed_until IS NULL) THEN 'jobs_claim_has_lease'
        WHEN max_attempts < 1 THEN 'jobs_max_attempts_check'
        WHEN queue <> 'default' AND queue !~ '^[a-z0-9_][a-z0-9_.-]{0,62}$' THEN 'jobs_queue_format'
        WHEN length(type) NOT BETWEEN 1 AND 200 THEN 'jobs_type_check'
    END;
END;

-- Raise the error a CHECK constraint would have. Called only for a row that
-- breaks a rule (inside a CASE), so a valid statement never calls it; its
-- integer result lets it stand where a row's count does. VOLATILE, and it
-- must stay so: the planner never evaluates such a function ahead of time,
-- so a CASE arm that calls it cannot raise while a query is planned.
CREATE FUNCTION relay.job_refuse(job_id bigint, rule text) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'new row for relation "jobs" violates check constraint "%"', rule
        USING ERRCODE = 'check_violation', CONSTRAINT = rule, SCHEMA = 'relay', TABLE = 'jobs',
              DETAIL = format('Failing row has id %s.', job_id);
END
$$;

CREATE OR REPLACE FUNCTION relay.jobs_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Every row is checked here, whichever branch then counts them.
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT min(queue), min(status), sum(checked) FROM (
        SELECT queue, status,
               CASE WHEN broken IS NULL THEN 1 ELSE relay.job_refuse(id, broken) END AS checked
        FROM (
            SELECT id, queue, status,
                   relay.job_rule_broken(type, queue, max_attempts, status, claimed_by, claimed_until) AS broken
            FROM inserted_jobs
        ) AS rows
    ) AS checked_rows
    HAVING min(queue) = max(queue) AND min(status) = max(status);
    IF NOT FOUND THEN
        -- Mixed queues or states, or no rows at all (which inserts nothing here either).
        INSERT INTO relay.job_counts (queue, state, n)
        SELECT queue, status, count(*) FROM inserted_jobs GROUP BY queue, status;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION relay.jobs_counted_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Heartbeats and other updates that move no job net to zero and write nothing.
    -- Every new row is checked as it is counted.
    INSERT INTO relay.job_counts (queue, state, n)
    SELECT queue, state, sum(n) FROM (
        SELECT queue, status AS state, -1 AS n FROM old_jobs
        UNION ALL
        SELECT queue, status, CASE WHEN broken IS NULL THEN 1 ELSE relay.job_refuse(id, broken) END
        FROM (
            SELECT id, queue, status,
                   relay.job_rule_broken(type, queue, max_attempts, status, claimed_by, claimed_until) AS broken
            FROM new_jobs
        ) AS rows
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
