-- Relay's own inserts add their jobs to the admin counters, and check the
-- table's rules for them, in the INSERT statement itself; the insert trigger
-- now fires per row, and only for rows inserted some other way (by hand, or by
-- a release from before this migration).
--
-- Why: the statement trigger's transition table, its plpgsql call and the
-- INSERT it made through SPI were the largest part of what a one-job enqueue
-- cost beyond a bare insert. One-job transactions on one connection, committed
-- one by one as in the benchmark's W2 (21 interleaved rounds of 1,000, medians,
-- with the enqueue's client path below the cursor in both): 464 us per
-- transaction with the statement trigger, 433 us with the count in the
-- statement, where a bare insert into the ceiling's table took 395 us.
--
-- counted_by_insert: true on a row whose inserting statement counted and
-- checked it itself (every INSERT of relay_core/sql/queries.sql sets it, and
-- adds its rows' deltas through relay.job_rule_broken and relay.job_refuse,
-- as the trigger does). An INSERT that leaves it false, as every INSERT that
-- does not name it does, is counted and checked row by row by the trigger
-- below: a bulk load by hand pays a trigger call and a delta row per job, so
-- enqueue_many is the way to add many. Setting it true without counting the
-- rows leaves the counters short by them. Nothing reads it after the insert.
--
-- The column's default is a constant, so adding it rewrites nothing; the ALTER
-- takes the table's exclusive lock for that moment.
ALTER TABLE relay.jobs ADD COLUMN counted_by_insert boolean NOT NULL DEFAULT false;

-- The rules and the count of one row inserted without counting itself: the
-- same refusal (SQLSTATE 23514, naming the broken rule) and the same delta as
-- the statement trigger made.
CREATE FUNCTION relay.jobs_counted_insert_row() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    broken text := relay.job_rule_broken(NEW.type, NEW.queue, NEW.max_attempts, NEW.status,
                                         NEW.claimed_by, NEW.claimed_until);
BEGIN
    IF broken IS NOT NULL THEN
        PERFORM relay.job_refuse(NEW.id, broken);
    END IF;
    INSERT INTO relay.job_counts (queue, state, n) VALUES (NEW.queue, NEW.status, 1);
    RETURN NULL;
END
$$;

-- relay.jobs_counted_insert(), the statement trigger's function, stays for a
-- release still running that might name it; no trigger calls it any more.
DROP TRIGGER jobs_counted_insert ON relay.jobs;
CREATE TRIGGER jobs_counted_insert AFTER INSERT ON relay.jobs
    FOR EACH ROW WHEN (NOT NEW.counted_by_insert) EXECUTE FUNCTION relay.jobs_counted_insert_row();
