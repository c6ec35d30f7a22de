-- Which periodic schedules each worker checks. A tick that fell due while a
-- worker served the schedule's queue counted as seen on time, however late a
-- check came; but a worker of a deploy that had removed the schedule never
-- checks it. When a later deploy brought the schedule back unchanged, the tick
-- that fell due in between was enqueued at once, catch_up or not: a daily 03:00
-- job ran mid-afternoon. A worker now records the schedules it checks, and a
-- worker without the schedule no longer counts. One registered by an older
-- Relay (NULL here) counts by its queues alone, as before.
ALTER TABLE relay.workers ADD COLUMN schedules text[];
