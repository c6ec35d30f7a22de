-- Which worker published each schedule's definition (cron, time zone, queue).
-- Only workers whose schedule is the one published enqueue its ticks, so that
-- in a rolling deploy that changes a schedule the old release's workers leave
-- it to the new ones. But the last worker to start publishes, and an old
-- worker restarted during the deploy published the old definition again:
-- once it stopped, every worker of the new release would have left the
-- schedule to a definition nobody checked. A worker now takes a schedule
-- over, publishing its own, when the worker that published it no longer
-- checks it. Published by an older Relay (NULL here), it counts as unchecked.
ALTER TABLE relay.schedules ADD COLUMN published_by text;
