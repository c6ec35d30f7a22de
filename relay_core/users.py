"""Users of the admin surface: Argon2id passwords, roles, and the login throttle.

Flask-free so the CLI (``relay user create``), the demo and the web app share
one implementation. Hashes are Argon2id PHC strings: their parameters travel
with them, so raising the parameters upgrades each stored hash at its owner's
next successful login. The throttle lives in PostgreSQL because a throttle in
one web process's memory is dodged by the next process behind the balancer.
"""

from __future__ import annotations

import ipaddress
import math
import re
import secrets
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import psycopg
from argon2 import PasswordHasher, Type, extract_parameters
from argon2.exceptions import HashingError, InvalidHashError, VerificationError
from psycopg.rows import dict_row

from .errors import ConfigurationError, RelayError
from .queries import sql

ROLES = ("admin", "viewer")
USERNAME = re.compile(r"^[a-z0-9_.@-]{1,150}$")
MIN_PASSWORD_LENGTH = 8
#: Longer inputs are refused before hashing: Argon2 would accept them, but a
#: megabyte "password" is a way to make the server work, not a password.
MAX_PASSWORD_LENGTH = 1024
#: Throttle keys keep this much of a username, however long the name tried.
_MAX_KEY_NAME = 200


class UserError(RelayError):
    """A user could not be created, changed or found."""


class InvalidUserError(UserError, ValueError):
    """A username, password or role was refused; ``field`` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UserExists(UserError):
    """The username is taken."""


class UserNotFound(UserError, LookupError):
    """No user has this name."""


class LoginThrottled(UserError):
    """Too many login attempts for this username or from this address; ``wait`` seconds until the next."""

    def __init__(self, wait: int) -> None:
        super().__init__(f"too many login attempts; try again in {wait} seconds")
        self.wait = wait


@dataclass(frozen=True)
class User:
    """A user as the rest of Relay sees it: never with the password hash."""

    id: int
    username: str
    role: str
    created_at: datetime
    password_changed_at: datetime
    last_login_at: datetime | None

    @property
    def is_admin(self) -> bool:
        """Admins may act on jobs; viewers only read."""
        return self.role == "admin"


# -- hashing -------------------------------------------------------------------


#: Argon2 parameters Relay accepts: name -> (its setting, smallest, largest).
#: Time cost: argon2's own 32-bit bound. Memory (KiB): up to 4 GiB for one hash,
#: which every login would allocate. Parallelism: threads per hash.
ARGON2_BOUNDS: dict[str, tuple[str, int, int]] = {
    "time_cost": ("RELAY_ARGON2_TIME_COST", 1, 2**32 - 1),
    "memory_cost": ("RELAY_ARGON2_MEMORY_COST", 8, 4 * 1024 * 1024),
    "parallelism": ("RELAY_ARGON2_PARALLELISM", 1, 64),
}


@lru_cache(maxsize=8)
def make_hasher(
    time_cost: int | None = None, memory_cost: int | None = None, parallelism: int | None = None
) -> PasswordHasher:
    """An Argon2id hasher; None keeps argon2-cffi's defaults (RFC 9106's low-memory profile).

    Values out of bounds raise ConfigurationError here, where the settings are
    read, rather than an OverflowError or HashingError at the first password.
    """
    defaults = PasswordHasher()
    chosen = {
        "time_cost": time_cost or defaults.time_cost,
        "memory_cost": memory_cost or defaults.memory_cost,
        "parallelism": parallelism or defaults.parallelism,
    }
    for name, value in chosen.items():
        setting, low, high = ARGON2_BOUNDS[name]
        if not low <= value <= high:
            raise ConfigurationError(f"{setting} must be between {low} and {high}, got {value}")
    if chosen["memory_cost"] < 8 * chosen["parallelism"]:
        raise ConfigurationError(
            "RELAY_ARGON2_MEMORY_COST must be at least 8 KiB per lane "
            f"(8 x RELAY_ARGON2_PARALLELISM = {8 * chosen['parallelism']}), got {chosen['memory_cost']}"
        )
    return PasswordHasher(**chosen, type=Type.ID)


@lru_cache(maxsize=8)
def _decoy_hash(time_cost: int, memory_cost: int, parallelism: int, hash_len: int, salt_len: int) -> str:
    # Verified against when the username is unknown, so a wrong name costs as
    # long as a wrong password and response times do not reveal who exists.
    hasher = PasswordHasher(time_cost, memory_cost, parallelism, hash_len, salt_len, type=Type.ID)
    return hasher.hash(secrets.token_urlsafe(32))


def _decoy_like(typical_hash: str | None, hasher: PasswordHasher) -> str:
    """A hash of no one's password that costs what verifying ``typical_hash`` costs.

    Verifying runs with the parameters written in the stored hash, not with
    ``hasher``'s: once an operator changed ``RELAY_ARGON2_*``, or created users
    from a shell without the web service's settings, a decoy made with
    ``hasher`` would take longer or shorter than a real user's wrong password,
    and the time of a login would tell who exists. So the decoy is made like
    a stored hash (``typical_hash``), and like ``hasher``'s only when there
    are no users, or that hash is no Argon2id within ``ARGON2_BOUNDS``.
    """
    try:
        typical = extract_parameters(typical_hash) if typical_hash else None
    except InvalidHashError:
        typical = None
    if typical is not None and typical.type is Type.ID:
        within = all(low <= getattr(typical, name) <= high for name, (_, low, high) in ARGON2_BOUNDS.items())
        if within:
            try:
                # Salt and hash lengths barely change the time; those of a hash edited by hand may be unusable.
                return _decoy_hash(
                    typical.time_cost, typical.memory_cost, typical.parallelism, hasher.hash_len, hasher.salt_len
                )
            except HashingError:
                pass  # parameters no hash can be made with (a hash edited by hand: too little memory for its lanes)
    return _decoy_hash(hasher.time_cost, hasher.memory_cost, hasher.parallelism, hasher.hash_len, hasher.salt_len)


# -- validation ----------------------------------------------------------------


def normalize_username(username: Any) -> str:
    """Lowercase a username and check it: 1-150 of a-z, 0-9, '_', '.', '@', '-'."""
    if not isinstance(username, str):
        raise InvalidUserError("username", "must be a string")
    name = username.lower()
    if not USERNAME.fullmatch(name):
        raise InvalidUserError("username", "use 1-150 of a-z, 0-9, '_', '.', '@', '-'")
    return name


def check_password(password: Any) -> str:
    """A password is a string of 8 to 1024 characters of UTF-8 text without NUL.

    POST /api/auth/login refuses NUL, so such a password could not log in
    there; standard input hands bytes that are not UTF-8 over as lone
    surrogates, which cannot be hashed.
    """
    if not isinstance(password, str):
        raise InvalidUserError("password", "must be a string")
    if "\x00" in password:
        raise InvalidUserError("password", "must not contain NUL characters")
    try:
        password.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidUserError("password", "must be valid UTF-8 text") from None
    if len(password) < MIN_PASSWORD_LENGTH:
        raise InvalidUserError("password", f"must be at least {MIN_PASSWORD_LENGTH} characters")
    if len(password) > MAX_PASSWORD_LENGTH:
        raise InvalidUserError("password", f"must be at most {MAX_PASSWORD_LENGTH} characters")
    return password


def check_role(role: Any) -> str:
    """``admin`` or ``viewer``."""
    if role not in ROLES:
        raise InvalidUserError("role", f"must be one of {', '.join(ROLES)}")
    return role


# -- users ---------------------------------------------------------------------


def _rows(conn: psycopg.Connection, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql(name), params)
        return cur.fetchall() if cur.description else []


def _user(row: dict[str, Any]) -> User:
    return User(**{k: v for k, v in row.items() if k not in ("password_hash", "kind_hashes")})


def create_user(
    conn: psycopg.Connection, username: str, password: str, role: str, *, hasher: PasswordHasher | None = None
) -> User:
    """Create a user; raise :class:`UserExists` if the name is taken."""
    name = normalize_username(username)
    check_role(role)
    digest = (hasher or make_hasher()).hash(check_password(password))
    rows = _rows(conn, "user_insert", {"username": name, "password_hash": digest, "role": role})
    if not rows:
        raise UserExists(f"user {name!r} already exists")
    return _user(rows[0])


def authenticate(
    conn: psycopg.Connection, username: str, password: str, *, hasher: PasswordHasher | None = None
) -> User | None:
    """The user whose name and password these are, or None.

    A refusal verifies a decoy like each set of parameters the stored
    hashes have (``_decoy_like``; the four most common), the user's own
    hash standing in for its own set: as much work whoever the name. With
    one decoy, made like the most common hash, a wrong password of a user
    whose hash had other parameters (made before ``RELAY_ARGON2_*`` changed
    and not upgraded since, or from a shell without the web service's
    settings) took measurably longer or shorter than an unknown name's,
    which told that user exists. Two kinds of user still verify one hash
    more than an unknown name: one whose parameters are the fifth set or
    rarer, and one whose hash no decoy can be made like (no Argon2id within
    ``ARGON2_BOUNDS``). A hash made with other parameters than ``hasher``'s
    is replaced by a fresh one on success.
    """
    hasher = hasher or make_hasher()
    try:
        name = normalize_username(username)
    except InvalidUserError:
        name = None
    (found,) = _rows(conn, "user_get_for_login", {"username": name})
    decoys = list(dict.fromkeys(_decoy_like(kind, hasher) for kind in found["kind_hashes"] or [None]))
    if not isinstance(password, str) or len(password) > MAX_PASSWORD_LENGTH:
        password = ""
    if found["id"] is None:
        _verify_each(hasher, decoys, password)
        return None
    stored = found["password_hash"]
    if not _verify_each(hasher, [stored], password):
        own = _cost(stored)
        _verify_each(hasher, [decoy for decoy in decoys if _cost(decoy) != own], password)
        return None
    new_hash = hasher.hash(password) if hasher.check_needs_rehash(stored) else None
    _rows(conn, "user_logged_in", {"id": found["id"], "verified_hash": stored, "new_hash": new_hash})
    return _user(found)


def _verify_each(hasher: PasswordHasher, hashes: list[str], password: str) -> bool:
    """Verify ``password`` against each of ``hashes``; whether any matched."""
    matched = False
    for stored in hashes:
        with suppress(VerificationError, InvalidHashError):
            matched = hasher.verify(stored, password) or matched
    return matched


def _cost(stored: str) -> tuple[int, int, int] | None:
    """The Argon2 time cost, memory cost and parallelism ``stored`` is verified with; None if it is no Argon2 hash."""
    try:
        parameters = extract_parameters(stored)
    except InvalidHashError:
        return None
    return parameters.time_cost, parameters.memory_cost, parameters.parallelism


def get_user(conn: psycopg.Connection, user_id: int) -> User | None:
    """A user by id, or None if there is none (deleted since the token was issued)."""
    rows = _rows(conn, "user_get", {"id": user_id})
    return _user(rows[0]) if rows else None


def list_users(conn: psycopg.Connection) -> list[User]:
    """Every user, by name."""
    return [_user(row) for row in _rows(conn, "user_list", {})]


def set_password(
    conn: psycopg.Connection, username: str, password: str, *, hasher: PasswordHasher | None = None
) -> None:
    """Give a user a new password; their refresh tokens stop working."""
    digest = (hasher or make_hasher()).hash(check_password(password))
    if not _rows(conn, "user_set_password", {"username": normalize_username(username), "password_hash": digest}):
        raise UserNotFound(f"no user {username!r}")


def set_role(conn: psycopg.Connection, username: str, role: str) -> None:
    """Make a user an admin or a viewer."""
    if not _rows(conn, "user_set_role", {"username": normalize_username(username), "role": check_role(role)}):
        raise UserNotFound(f"no user {username!r}")


def delete_user(conn: psycopg.Connection, username: str) -> None:
    """Remove a user."""
    if not _rows(conn, "user_delete", {"username": normalize_username(username)}):
        raise UserNotFound(f"no user {username!r}")


# -- ended sessions --------------------------------------------------------------


def end_session(conn: psycopg.Connection, session_id: str, expires_at: datetime) -> None:
    """Refuse a session's tokens from now on (``expires_at``: when they would have run out anyway).

    Also forgets a batch of ended sessions past that time, so the table holds
    no more than the sessions that could still be used.
    """
    _rows(conn, "session_end_prune", {})
    _rows(conn, "session_end", {"session_id": session_id, "expires_at": expires_at})


def session_ended(conn: psycopg.Connection, session_id: str) -> bool:
    """Whether the session was logged out."""
    return bool(_rows(conn, "session_is_ended", {"session_id": session_id})[0]["ended"])


# -- login throttle --------------------------------------------------------------


@dataclass(frozen=True)
class ThrottlePolicy:
    """How many login attempts a username and a client address get per window.

    The address limit is higher: one office behind one NAT address shares it.
    """

    window_seconds: float = 900.0
    max_per_user: int = 5
    max_per_address: int = 50

    def __post_init__(self) -> None:
        if self.window_seconds <= 0 or self.max_per_user < 1 or self.max_per_address < 1:
            raise RelayError("login throttle limits must be positive")


def _throttle_keys(username: str, address: str | None) -> tuple[str, str | None]:
    user_key = "user:" + username.lower()[:_MAX_KEY_NAME]
    return user_key, ("addr:" + client_network(address)) if address else None


def client_network(address: str) -> str:
    """What the per-address limit counts ``address`` as: an IPv6 address's /64, anything else as it is.

    One IPv6 client is given a /64 (RFC 6177, and what providers hand out),
    so it has more addresses than there could ever be attempts: counted one
    by one, each of its guesses would start with a fresh limit. An
    IPv4-mapped IPv6 address is the IPv4 address it maps. A port some proxies
    append (``[2001:db8::1]:443``, ``192.0.2.1:443``) is left out.
    """
    host = address
    if address.startswith("["):
        inside, closed, _ = address[1:].partition("]")
        host = inside if closed else address
    elif address.count(":") == 1:
        host = address.partition(":")[0]
    try:
        parsed = ipaddress.ip_address(host)
    except ValueError:
        return address[:_MAX_KEY_NAME]
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


def throttle_hit(conn: psycopg.Connection, policy: ThrottlePolicy, username: str, address: str | None) -> int | None:
    """Count one login attempt; return the seconds to wait if it is over a limit, else None.

    Commits on its own, before the password is checked, so every web process
    sees the attempt at once.
    """
    user_key, address_key = _throttle_keys(username, address)
    limits = {user_key: policy.max_per_user}
    if address_key:
        limits[address_key] = policy.max_per_address
    with conn.transaction():
        rows = _rows(conn, "login_throttle_hit", {"keys": sorted(limits), "window_seconds": policy.window_seconds})
        _rows(conn, "login_throttle_prune", {"window_seconds": policy.window_seconds})
    waits = [row["seconds_left"] for row in rows if row["failures"] > limits[row["key"]]]
    if not waits:
        return None
    return max(1, math.ceil(max(waits)))


def log_in(
    conn: psycopg.Connection,
    policy: ThrottlePolicy,
    username: str,
    password: str,
    address: str | None,
    *,
    hasher: PasswordHasher | None = None,
) -> User | None:
    """The user whose name and password these are, or None; raises :class:`LoginThrottled` over a limit.

    Every login, the API's and the dashboard's, keeps this order: the attempt
    is counted (and committed) before the password is checked, so parallel
    guesses cannot slip past the limit, and only a login that succeeded
    forgives its username's earlier failures.
    """
    wait = throttle_hit(conn, policy, username, address)
    if wait is not None:
        raise LoginThrottled(wait)
    user = authenticate(conn, username, password, hasher=hasher)
    if user is not None:
        throttle_forgive(conn, username, address)
    return user


def throttle_forgive(conn: psycopg.Connection, username: str, address: str | None) -> None:
    """A login succeeded: clear its username's count and take back its address's attempt."""
    user_key, address_key = _throttle_keys(username, address)
    with conn.transaction():
        _rows(conn, "login_throttle_forgive", {"user_key": user_key, "address_key": address_key})
