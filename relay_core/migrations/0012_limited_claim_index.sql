-- The claim's index when job types have limits: runnable jobs per queue and
-- type, in claim order. A limited claim walks each queue type by type (a skip
-- scan over this index finds the types), so jobs of a type held back by its
-- limit are never read, however many there are. Like jobs_runnable_idx it
-- holds queued jobs only: finished history never enters it, and a job leaves
-- it when it is claimed.
CREATE INDEX jobs_runnable_type_idx ON relay.jobs (queue, type, priority, run_at, id) WHERE status = 'queued';
