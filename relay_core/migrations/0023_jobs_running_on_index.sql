-- Jobs that left 'claimed' while their handler's thread still ran: a
-- graceful shutdown handed them back (or wrote their timeouts) and then the
-- process went on until it exited. Their claimed_until says when that thread
-- stops at the latest (job_hand_back_many and job_fail_many write it), and
-- THE CLAIM counts them against their type's max_running until then, reading
-- them from this index.
--
-- Why: the claim counted only claimed jobs, so from a shutdown's last write
-- to its process's exit (about a second) another worker started more jobs of
-- a limited type beside the handlers still running: six at once against a
-- limit of three. The index holds only such jobs (until they are claimed
-- again, or pruned once ended), a handful per deploy, so the count costs the
-- claim one small index probe per limited type.
--
-- The build takes the table's SHARE lock (writes wait; reads go on) for
-- about as long as a read of the whole table.
CREATE INDEX jobs_running_on_idx ON relay.jobs (type, claimed_until)
    WHERE status <> 'claimed' AND claimed_until IS NOT NULL;
