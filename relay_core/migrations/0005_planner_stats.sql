-- Give the planner true statistics for Relay's small settings tables from the
-- start. A table never analyzed is assumed to hold hundreds of rows, which made
-- the claim's plan look expensive enough for PostgreSQL to JIT-compile it on
-- connections that leave JIT on; analyzed empty tables are estimated as empty.
ANALYZE relay.type_limits;
ANALYZE relay.queues;
ANALYZE relay.rate_starts;
ANALYZE relay.schedules;
