"""What the ``relay`` command line accepts: the app to load, numbers, queue names, payloads and job ids.

Each reader turns a bad value into click's usage error (exit 2) in words
for the user, never a traceback: the checks Relay's Python API makes, said
for a shell.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import traceback
from collections import Counter
from pathlib import Path

import click

from .client import Relay
from .errors import InvalidJobError, RelayError
from .jsonb import float_changes
from .validation import check_queue, positive_number


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, refusing NaN and infinity as well.

    Every comparison with NaN is false, so FloatRange let it through any
    bounds: ``relay prove --timeout nan`` enqueued its jobs and started its
    workers before stopping at once, and ``relay demo --orders-per-minute
    nan`` enqueued orders as fast as it could. No option of Relay's means an
    endless or undefined number of seconds.
    """

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def load_app(spec: str) -> Relay:
    """Import ``MODULE:ATTR`` and return the Relay object it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{spec!r} is not MODULE:ATTR (for example myapp.jobs:relay)", param_hint="--app")
    if module_name.startswith("."):
        # importlib refuses a relative name without a package to resolve it in (a TypeError).
        raise click.BadParameter(
            f"{module_name!r} is a relative module name: give the full dotted name (for example myapp.jobs:relay)",
            param_hint="--app",
        )
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`, find modules in the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if not _names_the_module(exc, module_name):
            raise  # the module itself failed to import something: its traceback says where
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}", param_hint="--app") from exc
    except RelayError as exc:
        # Relay refused something the module declares (a handler's cron, a duplicate type):
        # one line, with the line of the module that declared it.
        raise click.ClickException(f"{spec}: {exc}{_declared_at(exc)}") from None
    app = getattr(module, attr, None)
    if not isinstance(app, Relay):
        raise click.BadParameter(f"{spec!r} is not a relay_core.Relay instance", param_hint="--app")
    return app


def _names_the_module(exc: ImportError, module_name: str) -> bool:
    """Whether ``exc`` says ``module_name`` (or a package it is in) is not there, rather than something it imports."""
    missing = exc.name
    return missing is not None and (module_name == missing or module_name.startswith(missing + "."))


def _declared_at(exc: BaseException) -> str:
    """ " (at FILE:LINE)" for the innermost frame of ``exc``'s traceback outside Relay itself; "" if none."""
    relay_dir = Path(__file__).resolve().parent
    place = ""
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = Path(frame.f_code.co_filename)
        if path.is_absolute() and relay_dir not in path.resolve().parents and "<frozen" not in path.name:
            place = f" (at {path}:{line})"
    return place


def queue_names(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    """``--queues`` as names, each checked as it is read: a bad one is the caller's own input (exit 2,
    before the app is imported), as a value click cannot read is. ``--queues ''`` names no queue
    and is refused as such, not read as "not given"."""
    if value is None:
        return None
    names = tuple(q.strip() for q in value.split(",") if q.strip())
    if not names:
        raise click.BadParameter("names no queue: a worker needs at least one")
    for name in names:
        try:
            check_queue(name)
        except InvalidJobError as exc:
            raise click.BadParameter(exc.message) from None
    return names


class _Unreadable(Exception):
    """A PAYLOAD token Relay cannot carry, in words for the user."""


def _not_json(token: str) -> float:
    raise _Unreadable(f"not valid JSON: {token} is not a JSON value")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise _Unreadable(f"has a number too large to carry: {token}")
    if float_changes(token, value):
        raise _Unreadable(f"has a number a float would change: {token}; send it as a string")
    return value


def _once_each(pairs: list[tuple[str, object]]) -> dict[str, object]:
    counts = Counter(key for key, _ in pairs)
    if len(counts) < len(pairs):
        repeated = sorted(key for key, n in counts.items() if n > 1)
        raise _Unreadable(f"repeats a key within one object: {', '.join(json.dumps(k) for k in repeated)}")
    return dict(pairs)


def parse_payload(text: str) -> object:
    """PAYLOAD as JSON; anything Python's reader refuses is a usage error, never a traceback.

    Python's reader also takes NaN and Infinity, which JSON has not, and reads
    a number past a float's range (1e400) as infinity, which no JSON document
    can hold: both are refused here, as what they are. So is a number a float
    would store changed (1e-400 as 0.0, 17 digits and more rounded), and a key
    given twice in one object (the reader keeps the last), as the admin API
    refuses both.
    """
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite_float, object_pairs_hook=_once_each)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="PAYLOAD") from None
    except _Unreadable as exc:
        raise click.BadParameter(str(exc), param_hint="PAYLOAD") from None
    except ValueError:
        # Python refuses to read integers longer than its digit limit (a guard
        # against quadratic-time conversion), so such a payload cannot be sent.
        limit = sys.get_int_max_str_digits()
        raise click.BadParameter(f"has an integer longer than {limit} digits", param_hint="PAYLOAD") from None
    except RecursionError:
        raise click.BadParameter("is nested too deeply to read", param_hint="PAYLOAD") from None


class JobIdType(click.ParamType):
    """A job id as Relay writes it: plain ASCII digits within bigint.

    ``int()`` would also read "2_2", " 22" or Arabic-Indic digits as a real
    job's id, and the command would act on a job nobody named.
    """

    name = "job_id"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        job_id = positive_number(str(value))
        if job_id is None:
            self.fail(f"{value!r} is not a job id (a positive whole number, digits only)", param, ctx)
        return job_id
