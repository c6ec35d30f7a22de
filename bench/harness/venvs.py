"""One virtualenv per peer, installed from its pinned requirements and reused while they match.

A venv is rebuilt only when its requirements file or base interpreter
changed (a stamp file records both), so repeated runs start at once.
Relay and the ceiling need no venv: they run on the interpreter that runs
the harness, which must be able to import Relay (its dev or test venv).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .contestants import BENCH, Contestant

VENVS = BENCH / ".venvs"


class NotRunnable(Exception):
    """This contestant cannot run on this machine; the message says why."""


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]), int(out[1])


def base_python(minimum: tuple[int, int]) -> str | None:
    """An interpreter of at least ``minimum``: this one, one on PATH, or one pyenv installed."""
    candidates = [getattr(sys, "_base_executable", sys.executable), sys.executable]
    for minor in range(minimum[1], 20):
        found = shutil.which(f"python{minimum[0]}.{minor}")
        if found:
            candidates.append(found)
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{minimum[0]}.*", "bin", "python")))
    for candidate in candidates:
        version = _version(candidate)
        if version and version >= minimum:
            return candidate
    return None


def current_python_for(contestant: Contestant) -> str:
    """The harness's own interpreter, checked to import what ``contestant`` needs."""
    module = "relay_core" if contestant.name == "relay" else "psycopg"
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise NotRunnable(f"{sys.executable} cannot import {module}: run the harness from Relay's virtualenv")
    return sys.executable


def _stamp(requirements: Path, base: str) -> str:
    digest = hashlib.sha256(requirements.read_bytes())
    digest.update(base.encode())
    return digest.hexdigest()


def _build(name: str, requirements: Path, base: str, log: Path) -> str | None:
    """Create (or reuse) ``bench/.venvs/<name>`` from ``requirements``; None if pip failed."""
    venv = VENVS / name
    python = venv / "bin" / "python"
    stamp_file = venv / ".bench-stamp"
    stamp = _stamp(requirements, base)
    if python.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return str(python)
    if venv.exists():
        shutil.rmtree(venv)
    with log.open("a") as out:
        subprocess.run([base, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out, timeout=300)
        installed = subprocess.run(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-r", str(requirements)],
            stdout=out,
            stderr=out,
            timeout=1800,
            check=False,
        )
    if installed.returncode != 0:
        return None
    stamp_file.write_text(stamp)
    return str(python)


def ensure(contestant: Contestant, log: Path) -> str:
    """The Python of ``contestant``'s venv, created or refreshed as needed."""
    requirements = contestant.requirements_file
    if requirements is None:
        return current_python_for(contestant)
    base = base_python(contestant.min_python)
    if base is None:
        wanted = ".".join(map(str, contestant.min_python))
        raise NotRunnable(f"not runnable here: needs Python >= {wanted}")
    python = _build(contestant.name, requirements, base, log)
    if python is None:
        raise NotRunnable(f"pip install -r {requirements.name} failed (see {log})")
    return python


def tools_python(log: Path, install: bool) -> str | None:
    """The venv with the chart's and the profiler's tools; None if absent and not to be installed."""
    python = VENVS / "tools" / "bin" / "python"
    if not install:
        return str(python) if python.exists() else None
    base = base_python((3, 11))
    if base is None:
        return None
    return _build("tools", BENCH / "requirements" / "tools.txt", base, log)
