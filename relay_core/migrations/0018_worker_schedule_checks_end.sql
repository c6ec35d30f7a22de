-- When a worker stopped checking its schedules. A worker's checks end as its
-- shutdown begins, but it stays registered (and heartbeats) while it drains
-- its in-flight jobs, up to RELAY_SHUTDOWN_TIMEOUT; a tick that fell due in
-- that time counted as seen by it, so the next worker to start enqueued it
-- late even with catch_up=False. A tick now counts as seen only by a worker
-- still checking when it fell due.
ALTER TABLE relay.workers ADD COLUMN schedules_stopped_at timestamptz;
