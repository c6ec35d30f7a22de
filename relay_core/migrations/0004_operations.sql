-- What running Relay for months needs: paused queues, per-type limits,
-- periodic schedules, cooperative cancellation, progress and results.

-- Cooperative cancellation of a running job: set by an admin, seen by the
-- worker at its next heartbeat; the status changes only when the handler stops.
ALTER TABLE relay.jobs ADD COLUMN cancel_requested_at timestamptz;
-- What a running handler last reported ({"percent": .., "message": ..}).
ALTER TABLE relay.jobs ADD COLUMN progress jsonb;
-- The handler's return value, size-limited, stored with its success.
ALTER TABLE relay.jobs ADD COLUMN result jsonb;

-- A row per queue that has been paused or resumed; a queue without a row runs.
-- Kept in the database so a pause survives restarts and reaches every worker.
CREATE TABLE relay.queues (
    name       text PRIMARY KEY CHECK (name ~ '^[a-z0-9_][a-z0-9_.-]{0,62}$'),
    paused     boolean NOT NULL DEFAULT false,
    paused_at  timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Limits per job type, written by workers from their handler declarations and
-- read by the claim query, so every worker honours them, even one that has no
-- handler for the type.
CREATE TABLE relay.type_limits (
    type                text PRIMARY KEY,
    -- At most this many jobs of the type claimed at once, across all workers.
    max_running         integer CHECK (max_running >= 1),
    -- At most rate_limit starts per rate_period_seconds, across all workers.
    rate_limit          integer CHECK (rate_limit >= 1),
    rate_period_seconds double precision CHECK (rate_period_seconds > 0),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CHECK ((rate_limit IS NULL) = (rate_period_seconds IS NULL))
);

-- One row per start of a rate-limited type: the claim counts the rows inside
-- the sliding window, maintenance deletes rows older than any window.
CREATE TABLE relay.rate_starts (
    type       text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX rate_starts_type_time_idx ON relay.rate_starts (type, started_at);

-- Periodic (cron) schedules. last_tick is the newest tick already enqueued:
-- advancing it is one guarded UPDATE, so exactly one worker enqueues each tick.
CREATE TABLE relay.schedules (
    type       text PRIMARY KEY,
    cron       text NOT NULL,
    timezone   text NOT NULL DEFAULT 'UTC',
    queue      text NOT NULL DEFAULT 'default',
    last_tick  timestamptz,
    next_tick  timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now()
);
