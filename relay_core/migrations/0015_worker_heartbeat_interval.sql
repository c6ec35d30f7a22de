-- When a silent worker counts as gone. The admin surface judged every worker
-- by one setting, RELAY_WORKER_STALE_SECONDS (default 60), but a worker
-- heartbeats every heartbeat_interval (lease / 3 by default, up to lease / 2):
-- with a 300 s lease, every 100 s, so a healthy worker read as gone for 40 s
-- of every 100, and its queues as served by no live worker. Each worker now
-- records its heartbeat interval at registration, and relay.worker_state is
-- the one place a state is decided: gone once silent for longer than both the
-- stale setting and two of its own heartbeat intervals. A worker registered
-- by an older Relay has no interval and is judged by the setting alone.
ALTER TABLE relay.workers ADD COLUMN heartbeat_seconds double precision;

CREATE FUNCTION relay.worker_state(
    stopped_at timestamptz, last_seen_at timestamptz, heartbeat_seconds double precision, stale_seconds double precision
) RETURNS text LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN stopped_at IS NOT NULL THEN 'stopped'
                WHEN last_seen_at >= now() - make_interval(
                         secs => greatest(stale_seconds, 2 * coalesce(heartbeat_seconds, 0))) THEN 'alive'
                ELSE 'gone' END
$$;
