-- The admin listings' index by status holds finished jobs only.
--
-- jobs_status_id_idx held every job, so each job wrote three entries to it:
-- at its enqueue, its claim and its completion (status changes are never HOT
-- updates: status is indexed). Queued and claimed jobs have indexes of their
-- own for a listing to start from (jobs_runnable_idx, jobs_lease_idx), and
-- the primary key read newest first finds them at once where they are the
-- newest jobs, as a backlog is. Finished jobs pile up in their millions and an
-- operator reads them newest first, the dead above all: they keep the index.
--
-- The old index is dropped first: the migration takes the table's exclusive
-- lock at once instead of upgrading to it after the build, which would
-- deadlock with a transaction that read jobs before the build and writes them
-- after. Reads and writes of relay.jobs wait from when the transactions using
-- the table end until the migration commits: about 1 s per 1,000,000 jobs on
-- the 2-core development machine.
DROP INDEX relay.jobs_status_id_idx;
CREATE INDEX jobs_finished_status_id_idx ON relay.jobs (status, id DESC)
    WHERE status IN ('succeeded', 'dead', 'cancelled');
