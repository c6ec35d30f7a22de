"""A tiny shop whose orders enqueue their follow-up work in the same transaction.

Copy it: it shows transactional enqueue with a SQLAlchemy session, idempotent
handlers, retries with growing gaps, dead jobs, scheduled and periodic jobs.

- ``models``: the shop's tables, in their own ``shop`` schema.
- ``orders``: ``place_order(session, ...)``, the order and its jobs in one commit.
- ``jobs``: the ``Relay`` object and every handler (``relay_shop.jobs:relay``).
- ``mail``, ``webhooks``: real SMTP and HTTP, kept apart from the job logic.
- ``producer``, ``smtp_sink``, ``webhook_endpoint``: what ``relay demo`` runs
  around the workers: a stream of orders, a local mail server, a flaky partner.
"""
