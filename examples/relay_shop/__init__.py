"""A tiny shop whose orders enqueue their follow-up work in the same transaction.

Copy it: it shows transactional enqueue with a SQLAlchemy session, idempotent
handlers, retries with growing gaps, dead jobs, scheduled and periodic jobs.
"""
