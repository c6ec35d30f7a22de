"""The benchmark harness: virtualenvs, databases, runs, and the report of Relay's bench."""
