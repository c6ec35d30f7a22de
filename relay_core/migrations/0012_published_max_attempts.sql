-- The max_attempts workers published for a job type (relay.job_types), read by
-- the one-job insert itself. An enqueue from a Relay without the type's handler
-- (a web process that only enqueues, `relay enqueue`, the admin API) used to
-- look it up in a statement of its own first: one more round trip on every such
-- enqueue (805 against 485 us per enqueue, median of 5 rounds of 2,000 on the
-- 2-core development machine). A sub-select in the INSERT would read and lock
-- relay.job_types on every enqueue, asked for or not; behind a function, it
-- runs only when called. PL/pgSQL keeps the lookup's plan for the session.
CREATE FUNCTION relay.published_max_attempts(job_type text, fallback integer) RETURNS integer
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN coalesce((SELECT max_attempts FROM relay.job_types WHERE type = job_type), fallback);
END
$$;
