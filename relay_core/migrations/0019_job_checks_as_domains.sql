-- A table CHECK constraint costs every INSERT and every UPDATE statement on
-- relay.jobs the parse and planning of its expression, whichever columns the
-- statement writes: PostgreSQL rebuilds the checks for each statement from
-- their stored text. The three checks of one column each move to a domain,
-- whose check is planned once per session and runs only where a value of the
-- column is written: the claim, the completions and the heartbeats no longer
-- pay for the type's length, the queue name or max_attempts. Which values are
-- accepted is unchanged, and a violation is still a check_violation (23514)
-- naming the same constraint. The lease check spans three columns and stays
-- on the table.
--
-- The domains are created without their checks so that changing the columns'
-- types rewrites nothing (jobs_runnable_idx, a partial index on queue, is
-- rebuilt: one read of the table under this migration's lock). The checks are
-- then added NOT VALID and not validated: the table's own validated checks,
-- dropped only in this transaction, held for every existing row, and
-- validating would read the table three more times under the lock to learn
-- nothing. New values are checked either way.
CREATE DOMAIN relay.job_type AS text;
CREATE DOMAIN relay.queue_name AS text;
CREATE DOMAIN relay.attempt_limit AS integer;

ALTER TABLE relay.jobs
    ALTER COLUMN type TYPE relay.job_type,
    ALTER COLUMN queue TYPE relay.queue_name,
    ALTER COLUMN max_attempts TYPE relay.attempt_limit;

ALTER DOMAIN relay.job_type
    ADD CONSTRAINT jobs_type_check CHECK (length(VALUE) BETWEEN 1 AND 200) NOT VALID;
ALTER DOMAIN relay.queue_name
    ADD CONSTRAINT jobs_queue_format CHECK (VALUE = 'default' OR VALUE ~ '^[a-z0-9_][a-z0-9_.-]{0,62}$') NOT VALID;
ALTER DOMAIN relay.attempt_limit
    ADD CONSTRAINT jobs_max_attempts_check CHECK (VALUE >= 1) NOT VALID;

ALTER TABLE relay.jobs
    DROP CONSTRAINT jobs_type_check,
    DROP CONSTRAINT jobs_queue_format,
    DROP CONSTRAINT jobs_max_attempts_check;
