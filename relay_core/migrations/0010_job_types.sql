-- The max_attempts each job type's handler declares, published by workers
-- when they register (as they publish relay.type_limits), so that an enqueue
-- whose own Relay has no handler for the type (`relay enqueue`, the admin
-- API's POST /api/admin/jobs, a service that only enqueues) gives its job the
-- attempts the handler's author chose instead of the default. Read only by
-- such enqueues, on the insert's connection; never by the claim.
CREATE TABLE relay.job_types (
    type         text PRIMARY KEY,
    -- The handler's max_attempts; the worker that registered last wins.
    max_attempts integer NOT NULL CHECK (max_attempts >= 1),
    -- When a worker last changed max_attempts (a restart that changes nothing writes nothing).
    updated_at   timestamptz NOT NULL DEFAULT now()
);
