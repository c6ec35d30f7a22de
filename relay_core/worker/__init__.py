"""The worker runtime."""

from __future__ import annotations

from .config import WorkerConfig
from .runtime import Worker, require_handlers

__all__ = ["Worker", "WorkerConfig", "require_handlers"]
