-- A rate window is at most 31 days, as registration already requires. The
-- table is one anyone with SQL access can write, and every worker's claim
-- evaluates statement_timestamp() - make_interval(secs => rate_period_seconds)
-- for every limit row: one 'Infinity' (or 1e300, or NaN, which passed the
-- "> 0" check) made that fail with "interval out of range", so every claim on
-- every queue failed until the row was removed. Rows past the bound already
-- held are brought down to it; the CHECK refuses new ones with an error that
-- names it. NaN compares above every number in PostgreSQL, so it is among them.
UPDATE relay.type_limits SET rate_period_seconds = 2678400 WHERE rate_period_seconds > 2678400;
ALTER TABLE relay.type_limits
    ADD CONSTRAINT type_limits_rate_window_at_most_31_days CHECK (rate_period_seconds <= 2678400);
