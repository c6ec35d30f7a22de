-- A worker's recorded heartbeat interval is read within bounds. Relay
-- writes a finite interval of a few seconds, but the registry is a table
-- anyone with SQL access can write: a heartbeat_seconds of NaN or 1e300 made
-- relay.worker_state fail ("interval out of range", "timestamp out of range"),
-- and with it the dashboard's overview, workers and queues pages. The
-- interval now counts for at most 10^8 s (about three years); NaN, larger
-- than any number to PostgreSQL, counts as that too. Same signature, so a
-- previous release's statements call it unchanged.
CREATE OR REPLACE FUNCTION relay.worker_state(
    stopped_at timestamptz, last_seen_at timestamptz, heartbeat_seconds double precision, stale_seconds double precision
) RETURNS text LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
                WHEN last_seen_at >= now() - make_interval(
                         secs => least(greatest(stale_seconds, 2 * coalesce(heartbeat_seconds, 0)), 1e8)) THEN 'alive'
                ELSE 'gone' END
$$;
