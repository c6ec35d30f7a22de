"""An embedded PostgreSQL for when no DATABASE_URL is set (tests, the demo).

The ``pgserver`` package ships real PostgreSQL binaries in its wheel; the data
directory is kept, so a second start reuses it.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

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
    return get_server(pgserver, data_dir, cleanup).get_uri()


def get_server(pgserver: ModuleType, data_dir: Path, cleanup: str | None) -> Any:
    """pgserver's server on ``data_dir``, started if need be; a ConfigurationError saying where to
    look when it cannot start.

    pgserver raised what its initdb or pg_ctl run ended with: some 80 lines of
    traceback ending in a ``CalledProcessError``, for a data directory another
    PostgreSQL's major version made (the demo's bundled server is 16 or 18 by
    the Python it runs on), a first start interrupted, a stale lock file.
    """
    said = _ErrorsSaid()
    pgserver_log = logging.getLogger("pgserver")
    pgserver_log.addHandler(said)
    propagated, pgserver_log.propagate = pgserver_log.propagate, False  # its dump of each failure, kept for the reason
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime dir; its fallback warning is noise here.
            warnings.simplefilter("ignore")
            return pgserver.get_server(str(data_dir), cleanup_mode=cleanup)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise ConfigurationError(_not_started(pgserver, data_dir, exc, said.reason())) from None
    finally:
        pgserver_log.removeHandler(said)
        pgserver_log.propagate = propagated


class _ErrorsSaid(logging.Handler):
    """pgserver's error records (each initdb or pg_ctl failure, its output and the server's log with it)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())

    def reason(self) -> str | None:
        """The last line that says what went wrong (initdb's "error:", the server's "FATAL:"), if any."""
        for line in reversed(self.lines):
            if re.search(r"\b(error|fatal|could not|no such)\b", line, re.IGNORECASE) and "Failed postgres" not in line:
                return line.strip()[:300]
        return None


def _not_started(pgserver: ModuleType, data_dir: Path, exc: BaseException, reason: str | None) -> str:
    """Why the embedded PostgreSQL on ``data_dir`` did not start, and where its log is."""
    ran = exc.cmd[0] if isinstance(exc, subprocess.CalledProcessError | subprocess.TimeoutExpired) else None
    what = f"{Path(ran).name} failed" if isinstance(ran, str) else type(exc).__name__
    said = f"the embedded PostgreSQL in {data_dir} did not start ({what}"
    said += f": {reason})" if reason else ")"
    if (data_dir / "log").exists():
        said += f"; its log: {data_dir / 'log'}"
    made_by = _major_version(data_dir / "PG_VERSION")
    bundled = _bundled_major_version(pgserver)
    if made_by and bundled and made_by != bundled:
        said += (
            f". Its data was made by PostgreSQL {made_by}, and this one is {bundled}: "
            "delete the directory to start over (relay demo --fresh does, for the demo's)"
        )
    return said


def _major_version(path: Path) -> str | None:
    """The major version a data directory's PG_VERSION file names, if it has one."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _bundled_major_version(pgserver: ModuleType) -> str | None:
    """The major version of pgserver's bundled PostgreSQL (``postgres --version``), if it answers."""
    binary = Path(pgserver.__file__).parent / "pginstall" / "bin" / "postgres"
    try:
        said = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(\d+)(?:\.\d+)?", said)
    return found.group(1) if found else None


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
