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
-- counted_by_transaction: the transaction whose INSERT counted and checked
-- the row itself. Every INSERT of relay_core/sql/queries.sql sets it to its
-- own (pg_current_xact_id()) and adds its rows' deltas, through
-- relay.job_rule_broken and relay.job_refuse, as the trigger does. A row
-- inserted any other way is counted and checked row by row by the trigger
-- below: one that does not name the column (NULL), and one copied whole from
-- elsewhere (INSERT ... SELECT *, COPY, a data-only restore), which carries
-- another transaction's. A bulk load by hand pays a trigger call, a delta row
-- and a queued trigger event per job, so enqueue_many is the way to add many.
--
-- The column has no default, so adding it rewrites nothing; the ALTER takes
-- the table's exclusive lock for that moment.
ALTER TABLE relay.jobs ADD COLUMN counted_by_transaction xid8;

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
    FOR EACH ROW WHEN (NEW.counted_by_transaction IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION relay.jobs_counted_insert_row();
