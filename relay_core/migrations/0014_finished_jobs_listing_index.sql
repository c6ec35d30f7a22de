-- The admin listings' index by status holds finished jobs only.
--
-- jobs_status_id_idx held every job, so each job wrote three entries to it:
-- at its enqueue, its claim and its completion (status changes are never HOT
-- updates: status is indexed). Queued and claimed jobs have indexes of their
-- own for a listing to start from (jobs_runnable_idx, jobs_lease_idx), and
-- the primary key read newest first finds them at once where they are the
-- newest jobs, as a backlog is. Finished jobs pile up in their millions and an
-- operator reads them newest first, the dead above all: they keep the index.
CREATE INDEX jobs_finished_status_id_idx ON relay.jobs (status, id DESC)
    WHERE status IN ('succeeded', 'dead', 'cancelled');
DROP INDEX relay.jobs_status_id_idx;
