"""An embedded PostgreSQL for when no DATABASE_URL is set (tests, the demo).

The ``pgserver`` package ships real PostgreSQL binaries in its wheel; the data
directory is kept, so a second start reuses it.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from types import ModuleType

from .errors import ConfigurationError

#: How to install what the demo and the embedded PostgreSQL need (the ``demo`` extra).
INSTALL_DEMO = "pip install 'relay-queue[demo]' (in a checkout: pip install -e '.[demo]')"


def default_data_dir() -> Path:
    """A per-user directory for the embedded cluster's data."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "relay" / "pgdata"


def start(data_dir: Path | None = None, *, cleanup: str = "stop") -> str:
    """Start (or reuse) an embedded PostgreSQL and return its DSN.

    ``cleanup="stop"`` stops the server when this process exits; ``"delete"``
    also removes its data; ``None`` leaves it running.
    """
    pgserver = load_pgserver()
    data_dir = data_dir or default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # pgserver asks platformdirs for a runtime dir; its fallback warning is noise here.
        warnings.simplefilter("ignore")
        server = pgserver.get_server(str(data_dir), cleanup_mode=cleanup)
    return server.get_uri()


def load_pgserver() -> ModuleType:
    """The ``pgserver`` module, or a ConfigurationError saying how to install it.

    Its log says only what went well: every initdb and pg_ctl run, output and
    all, at INFO, which the CLI shows. Its warnings and errors still show.
    """
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime dir at import; its fallback warning is noise here.
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError as exc:
        raise ConfigurationError(
            "no DATABASE_URL set and the embedded PostgreSQL (pgserver) is not installed: set DATABASE_URL, "
            f"or {INSTALL_DEMO}"
        ) from exc
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    return pgserver
