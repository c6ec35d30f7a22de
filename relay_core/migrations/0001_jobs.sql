-- Relay's queue: jobs, their wake-up channel and the worker registry.
-- Everything lives in the "relay" schema so Relay can share its users'
-- application database without touching their tables.

-- The migrator has made the schema by now; IF NOT EXISTS would still ask for the
-- privilege to create schemas in the database, which a role given only its own
-- schema (made for it beforehand) does not have.
DO $$
BEGIN
    IF to_regnamespace('relay') IS NULL THEN
        CREATE SCHEMA relay;
    END IF;
END
$$;

-- The states of DESIGN section 3; an enum keeps every row in exactly one of them.
CREATE TYPE relay.job_status AS ENUM ('queued', 'claimed', 'succeeded', 'dead', 'cancelled');

CREATE TABLE relay.jobs (
    -- Identity, not serial: ids are never reused and never written by callers.
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The handler name a worker looks up.
    type            text NOT NULL CHECK (length(type) BETWEEN 1 AND 200),
    -- Named queue; workers choose which queues they serve.
    queue           text NOT NULL DEFAULT 'default',
    -- Lower runs first (0 is the default, negative is urgent).
    priority        smallint NOT NULL DEFAULT 0,
    -- The handler's input, validated as JSON before it is written.
    payload         jsonb NOT NULL DEFAULT '{}'::jsonb,
    status          relay.job_status NOT NULL DEFAULT 'queued',
    -- Counted at claim time, so a job that kills its worker still reaches dead.
    attempts        integer NOT NULL DEFAULT 0,
    max_attempts    integer NOT NULL DEFAULT 20 CHECK (max_attempts >= 1),
    -- Earliest time the job may run, always from the database clock.
    run_at          timestamptz NOT NULL DEFAULT now(),
    -- Fencing token: bumped by every claim and never reset, so a worker whose
    -- lease was taken over can never match the job again (not even after a requeue).
    lease_token     integer NOT NULL DEFAULT 0,
    -- Worker id holding the lease, and when the lease runs out.
    claimed_by      text,
    claimed_until   timestamptz,
    -- Caller-chosen key: a second enqueue with it returns the first job.
    idempotency_key text,
    -- The newest failure, for listing; the whole history is in errors.
    last_error      text,
    -- One object per failed attempt: attempt, at, worker, error type, message, traceback.
    errors          jsonb NOT NULL DEFAULT '[]'::jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Start of the latest attempt and end of the job (succeeded, dead or cancelled).
    started_at      timestamptz,
    finished_at     timestamptz,
    CONSTRAINT jobs_queue_format CHECK (queue ~ '^[a-z0-9_][a-z0-9_.-]{0,62}$'),
    CONSTRAINT jobs_claim_has_lease CHECK (status <> 'claimed' OR (claimed_by IS NOT NULL AND claimed_until IS NOT NULL))
) WITH (
    -- Every job is updated at least twice: leave room on each page so updates can stay on the page.
    fillfactor = 80,
    -- A queue table churns: vacuum it far more eagerly than the defaults.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- The claim query's index: runnable jobs only, in claim order, per queue.
CREATE INDEX jobs_runnable_idx ON relay.jobs (queue, priority, run_at, id) WHERE status = 'queued';

-- The sweeper's index: leases of claimed jobs, so finding expired ones never scans history.
CREATE INDEX jobs_lease_idx ON relay.jobs (claimed_until) WHERE status = 'claimed';

-- Idempotency keys are unique while their job row exists.
CREATE UNIQUE INDEX jobs_idempotency_key_idx ON relay.jobs (idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Admin listings: newest first per status (keyset pagination on id).
CREATE INDEX jobs_status_id_idx ON relay.jobs (status, id DESC);

-- Each worker process records itself here and heartbeats.
CREATE TABLE relay.workers (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    queues       text[] NOT NULL,
    concurrency  integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    in_flight    integer NOT NULL DEFAULT 0,
    -- Set on graceful shutdown; a worker that stops heartbeating without it died.
    stopped_at   timestamptz
);
