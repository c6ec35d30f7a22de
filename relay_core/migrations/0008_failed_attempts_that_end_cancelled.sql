-- An attempt that failed (its handler raised, or its lease ran out) while an
-- admin's cancel request was pending ends the job cancelled, and was not
-- counted as a failed attempt in relay.job_outcomes: /stats, its failure rate
-- and relay_jobs_failed_total missed it. Every failed attempt appends to the
-- job's error history and no other ending of an attempt does, so a move from
-- claimed to cancelled whose history changed is now counted as failed too. A
-- cooperative cancel, a snooze and a graceful hand-back leave the history
-- alone and stay uncounted. Nothing else in the function changes.
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
    SELECT date_trunc('minute', now()), n.queue, n.type,
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
