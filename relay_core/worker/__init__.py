"""The worker runtime."""

from __future__ import annotations

from .config import WorkerConfig
from .runtime import Worker

__all__ = ["Worker", "WorkerConfig"]
