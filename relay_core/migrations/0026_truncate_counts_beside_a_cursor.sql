-- TRUNCATE relay.jobs empties the counters with TRUNCATE (migration 0016), and
-- PostgreSQL refuses that (object_in_use) in two cases: the same statement
-- truncates relay.job_counts too (TRUNCATE relay.jobs, relay.job_counts), and
-- a cursor of the same session still reads relay.job_counts (a DECLARE, a
-- driver's server-side cursor). The trigger took every refusal for the first
-- case and left the counters as they were: in the second, they went on
-- counting every truncated job, for good.
--
-- On that refusal it now deletes the counters' rows instead. In the first case
-- they are gone already and nothing is deleted. In the second the DELETE
-- removes the deltas its snapshot sees: under READ COMMITTED every committed
-- one; under REPEATABLE READ a delta committed after the snapshot stays, the
-- weakness 0016 removed from the common path, kept here only for this case.
CREATE OR REPLACE FUNCTION relay.jobs_counted_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE relay.job_counts;
    RETURN NULL;
EXCEPTION WHEN object_in_use THEN
    DELETE FROM relay.job_counts;
    RETURN NULL;
END
$$;
