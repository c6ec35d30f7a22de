-- A schedule's last run. last_tick is the newest tick a worker claimed, and a
-- claimed tick is not always a run: registering a schedule sets it to the tick
-- before, and a tick skipped as missed (no worker ran when it fell due)
-- advances it too. So a new daily handler looked as if it had run hours ago.
-- last_enqueued_tick and last_job_id are written only by the statement after
-- the tick's job insert, in its transaction (worker.periodic.enqueue_due).
-- last_job_id has no foreign key: retention deletes jobs, and the id of the
-- last run is still worth showing once its row is gone (a foreign key would
-- also add a lookup to every pruned row).
ALTER TABLE relay.schedules
    ADD COLUMN last_enqueued_tick timestamptz,
    ADD COLUMN last_job_id bigint,
    -- Set here on a schedule older than this migration that has no job left
    -- to read its last run from: whether it ran before this moment is unknown.
    -- NULL: every tick enqueued since the schedule was registered is recorded.
    ADD COLUMN runs_recorded_since timestamptz;

-- Existing schedules: the newest job a tick enqueued and retention still keeps,
-- recognised by the idempotency key every tick's job carries. One read of the
-- jobs table; a payload whose key matches but whose tick is not a timestamp
-- (a job some other code enqueued with such a key) is left alone, a date that
-- looks like one but does not exist (2024-02-30) too: the cast would have
-- failed the migration, and every later one, until the row was found by hand.
-- (A function in Relay's schema, dropped below: a temporary one needs the TEMP
-- privilege on the database, which a role allowed only its own schema may lack.)
CREATE OR REPLACE FUNCTION relay.migration_0009_tick_or_null(tick text) RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN
    RETURN tick::timestamptz;
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END
$$;

UPDATE relay.schedules AS s
SET last_enqueued_tick = j.tick, last_job_id = j.id
FROM (
    SELECT DISTINCT ON (type) type, id, relay.migration_0009_tick_or_null(payload->>'scheduled_for') AS tick
    FROM relay.jobs
    WHERE idempotency_key LIKE 'cron:%'
      AND idempotency_key = 'cron:' || type || ':' || (payload->>'scheduled_for')
      AND payload->>'scheduled_for' ~ '^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?[+-]\d\d:\d\d(:\d\d)?$'
      AND relay.migration_0009_tick_or_null(payload->>'scheduled_for') IS NOT NULL
    ORDER BY type, id DESC
) AS j
WHERE j.type = s.type;

DROP FUNCTION relay.migration_0009_tick_or_null(text);

UPDATE relay.schedules SET runs_recorded_since = now() WHERE last_enqueued_tick IS NULL;
