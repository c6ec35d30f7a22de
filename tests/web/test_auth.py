"""Login, tokens, roles and the login throttle, against a real database."""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import jwt
import psycopg
import pytest
from argon2 import PasswordHasher, extract_parameters
from flask import Flask
from flask_jwt_extended import create_access_token, create_refresh_token

from relay_core import Relay, users

from .conftest import PASSWORD, SECRET, AuthActions
from .helpers import assert_problem


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def _claims(auth: AuthActions, role: str = "admin") -> dict:
    token = auth.tokens(role)["access_token"]
    return jwt.decode(token, SECRET, algorithms=["HS256"], issuer="relay")


def test_no_user_ships_with_relay(db: psycopg.Connection) -> None:
    assert db.execute("SELECT count(*) FROM relay.users").fetchone()[0] == 0


def test_login_returns_expiring_access_and_refresh_tokens(auth: AuthActions) -> None:
    auth.create_user("Alice", "admin")
    response = auth.login("alice")
    assert response.status_code == 200
    body = response.get_json()
    assert body["token_type"] == "Bearer"
    assert body["role"] == "admin" and body["username"] == "alice"
    assert body["expires_in"] == 900 and body["refresh_expires_in"] > body["expires_in"]
    claims = jwt.decode(body["access_token"], SECRET, algorithms=["HS256"], issuer="relay")
    assert claims["exp"] - claims["iat"] == 900
    assert claims["role"] == "admin"
    assert PASSWORD not in response.get_data(as_text=True)


def test_usernames_are_case_insensitive(auth: AuthActions) -> None:
    auth.create_user("Bob", "viewer")
    assert auth.login("BOB").status_code == 200


def test_wrong_password_and_unknown_user_answer_the_same_401(auth: AuthActions) -> None:
    auth.create_user("carol", "admin")
    wrong = assert_problem(auth.login("carol", "not the password"), 401, "login-failed")
    unknown = assert_problem(auth.login("nobody", "not the password"), 401, "login-failed")
    assert wrong["detail"] == unknown["detail"]


def test_admin_routes_need_a_token(client, auth: AuthActions) -> None:
    response = client.get("/api/admin/jobs")
    assert_problem(response, 401, "token-missing")
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert_problem(client.get("/api/admin/jobs", headers={"Authorization": "Basic YTpi"}), 401, "token-missing")
    assert_problem(client.get("/api/admin/jobs", headers={"Authorization": "Bearer"}), 401)


def test_the_bearer_scheme_is_read_in_any_case(client, auth: AuthActions) -> None:
    """HTTP's authentication schemes are case-insensitive (RFC 9110, 11.1)."""
    token = auth.headers("viewer")["Authorization"].removeprefix("Bearer ")
    for scheme in ("Bearer", "bearer", "BEARER", "  bEaReR"):
        answer = client.get("/api/admin/jobs", headers={"Authorization": f"{scheme} {token}"})
        assert answer.status_code == 200, (scheme, answer.get_json())
    assert client.get("/api/admin/jobs", headers={"Authorization": f"Basic {token}"}).status_code == 401
    assert client.get("/api/admin/jobs", headers={"Authorization": f"bearertoken {token}"}).status_code == 401


def test_a_token_stamped_by_a_web_process_whose_clock_runs_ahead_is_taken(auth: AuthActions, client) -> None:
    """Behind a balancer the token may come from a process whose clock runs a little ahead: PyJWT
    refused it as not yet valid (its iat and nbf in the future), and the API answered 401."""
    auth.create_user("dave", "admin")
    claims = jwt.decode(auth.login("dave").get_json()["access_token"], SECRET, algorithms=["HS256"], issuer="relay")
    for name in ("iat", "nbf", "exp"):
        claims[name] += 3
    ahead = jwt.encode(claims, SECRET, algorithm="HS256")
    response = client.get("/api/admin/queues", headers={"Authorization": f"Bearer {ahead}"})
    assert response.status_code == 200, response.get_json()


def test_expired_token_is_refused(app: Flask, client, auth: AuthActions) -> None:
    user = auth.create_user("dave", "admin")
    with app.app_context():
        token = create_access_token(
            identity=str(user.id), additional_claims={"role": "admin"}, expires_delta=timedelta(seconds=-30)
        )
    response = client.get("/api/admin/jobs", headers={"Authorization": f"Bearer {token}"})
    body = assert_problem(response, 401, "token-expired")
    assert "refresh" in body["detail"]
    assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]


def test_token_signed_with_another_key_is_refused(client, auth: AuthActions) -> None:
    claims = _claims(auth)
    forged = jwt.encode(claims, "another-key-" + "x" * 40, algorithm="HS256")
    assert_problem(client.get("/api/admin/jobs", headers={"Authorization": f"Bearer {forged}"}), 401, "token-invalid")


def test_alg_none_token_is_refused(client, auth: AuthActions) -> None:
    claims = _claims(auth)
    unsigned = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."
    assert_problem(client.get("/api/admin/jobs", headers={"Authorization": f"Bearer {unsigned}"}), 401, "token-invalid")


def test_tampered_role_is_refused(client, auth: AuthActions) -> None:
    token = auth.tokens("viewer")["access_token"]
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["role"] = "admin"
    tampered = f"{header}.{_b64(claims)}.{signature}"
    response = client.post("/api/admin/jobs/1/requeue", headers={"Authorization": f"Bearer {tampered}"})
    assert_problem(response, 401, "token-invalid")


def test_garbage_token_is_refused(client) -> None:
    for token in ("abc", "a.b.c", "é.é.é", "x" * 5000):
        assert_problem(client.get("/api/admin/jobs", headers={"Authorization": f"Bearer {token}"}), 401)


def test_viewer_reads_but_cannot_act(client, auth: AuthActions, relay) -> None:
    job_id = relay.enqueue("send_email", {"to": "a@b.c"})
    viewer = auth.headers("viewer")
    assert client.get("/api/admin/jobs", headers=viewer).status_code == 200
    assert client.get(f"/api/admin/jobs/{job_id}", headers=viewer).status_code == 200
    for path, body in (
        (f"/api/admin/jobs/{job_id}/requeue", None),
        (f"/api/admin/jobs/{job_id}/cancel", None),
        ("/api/admin/jobs/requeue", {}),
        ("/api/admin/jobs/cancel", {}),
        ("/api/admin/jobs", {"type": "x"}),
    ):
        assert_problem(client.post(path, headers=viewer, json=body), 403, "forbidden")
    assert relay.get_job(job_id).status == "queued"


def test_refresh_token_gives_a_new_access_token_with_the_current_role(client, auth: AuthActions, dsn: str) -> None:
    auth.create_user("erin", "admin")
    tokens = auth.login("erin").get_json()
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.set_role(conn, "erin", "viewer")
    response = client.post("/api/auth/refresh", headers={"Authorization": f"Bearer {tokens['refresh_token']}"})
    assert response.status_code == 200
    body = response.get_json()
    assert body["role"] == "viewer" and body["refresh_token"] is None
    assert_problem(
        client.post("/api/admin/jobs/1/requeue", headers={"Authorization": f"Bearer {body['access_token']}"}), 403
    )


def test_a_refresh_that_also_sends_its_token_in_a_body_is_answered(client, auth: AuthActions) -> None:
    """Many clients send the refresh token in a body as well as in the header; the body is ignored."""
    auth.create_user("frank", "admin")
    tokens = auth.login("frank").get_json()
    response = client.post(
        "/api/auth/refresh",
        headers={"Authorization": f"Bearer {tokens['refresh_token']}"},
        json={"refresh_token": tokens["refresh_token"]},
    )
    assert response.status_code == 200 and response.get_json()["access_token"]


def test_access_and_refresh_tokens_are_not_interchangeable(client, auth: AuthActions) -> None:
    tokens = auth.tokens("admin")
    assert_problem(client.post("/api/auth/refresh", headers={"Authorization": f"Bearer {tokens['access_token']}"}), 401)
    assert_problem(client.get("/api/admin/jobs", headers={"Authorization": f"Bearer {tokens['refresh_token']}"}), 401)


@pytest.mark.parametrize("subject", ["admin", "", "1_0", " 1", "+1", "01", "1.0", "١", "9" * 30, "9" * 5000])
def test_refresh_token_naming_no_user_id_is_401(app: Flask, client, auth: AuthActions, subject: str) -> None:
    # User 1's real session mark: read laxly, "01" or "١" would name user 1 and be trusted.
    real = jwt.decode(auth.tokens("admin")["refresh_token"], SECRET, algorithms=["HS256"], issuer="relay")
    with app.app_context():
        token = create_refresh_token(identity=subject, additional_claims={"pwd": real["pwd"]})
    response = client.post("/api/auth/refresh", headers={"Authorization": f"Bearer {token}"})
    assert_problem(response, 401, "token-invalid")
    assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]


def test_password_change_or_removal_ends_refresh_sessions(client, auth: AuthActions, dsn: str) -> None:
    auth.create_user("frank", "admin")
    auth.create_user("grace", "admin")
    frank = auth.login("frank").get_json()["refresh_token"]
    grace = auth.login("grace").get_json()["refresh_token"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.set_password(conn, "frank", "a brand new password", hasher=users.make_hasher(1, 1024, 1))
        users.delete_user(conn, "grace")
    for token in (frank, grace):
        response = client.post("/api/auth/refresh", headers={"Authorization": f"Bearer {token}"})
        assert_problem(response, 401, "session-ended")


def test_an_access_token_ends_at_once_when_its_user_is_removed_demoted_or_changes_password(
    client, auth: AuthActions, relay: Relay, dsn: str
) -> None:
    """Access tokens were checked by signature and expiry only: a deleted admin could pause queues
    for the rest of the token's lifetime, which RELAY_ACCESS_TOKEN_SECONDS lets run to a year."""
    for name in ("ivan", "judy", "kim"):
        auth.create_user(name, "admin")
    ivan, judy, kim = (
        {"Authorization": f"Bearer {auth.login(name).get_json()['access_token']}"} for name in ("ivan", "judy", "kim")
    )
    for holder in (ivan, judy, kim):
        assert client.get("/api/admin/jobs", headers=holder).status_code == 200
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.delete_user(conn, "ivan")
        users.set_password(conn, "judy", "a brand new password", hasher=users.make_hasher(1, 1024, 1))
        users.set_role(conn, "kim", "viewer")
    for holder in (ivan, judy):
        assert_problem(client.post("/api/admin/queues/default/pause", headers=holder), 401, "session-ended")
        assert_problem(client.get("/api/admin/jobs", headers=holder), 401, "session-ended")
    assert_problem(client.post("/api/admin/queues/default/pause", headers=kim), 403, "forbidden")
    assert client.get("/api/admin/jobs", headers=kim).status_code == 200
    assert relay.paused_queues() == []


def test_hash_is_upgraded_when_parameters_change(make_app, auth: AuthActions, db: psycopg.Connection) -> None:
    auth.create_user("heidi", "admin")
    before = db.execute("SELECT password_hash FROM relay.users WHERE username = 'heidi'").fetchone()[0]
    assert "m=1024,t=1,p=1" in before
    stronger = make_app(RELAY_ARGON2_TIME_COST=2, RELAY_ARGON2_MEMORY_COST=2048).test_client()
    assert stronger.post("/api/auth/login", json={"username": "heidi", "password": PASSWORD}).status_code == 200
    after = db.execute("SELECT password_hash, last_login_at FROM relay.users WHERE username = 'heidi'").fetchone()
    assert after[0].startswith("$argon2id$") and "m=2048,t=2,p=1" in after[0]
    assert after[1] is not None
    assert stronger.post("/api/auth/login", json={"username": "heidi", "password": PASSWORD}).status_code == 200


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(time cost, memory cost) of each hash a password is verified against from now on, in order."""
    seen: list[tuple[int, int]] = []
    verify = PasswordHasher.verify

    def recording_verify(self: PasswordHasher, stored: str, password: str) -> bool:
        parameters = extract_parameters(stored)
        seen.append((parameters.time_cost, parameters.memory_cost))
        return verify(self, stored, password)

    monkeypatch.setattr(PasswordHasher, "verify", recording_verify)
    return seen


def test_an_unknown_name_is_verified_like_the_stored_hashes_not_like_the_settings(
    make_app, auth: AuthActions, verified: list[tuple[int, int]]
) -> None:
    """Verifying runs with the parameters written in the stored hash. After RELAY_ARGON2_* changed, a
    decoy made with the new settings took 3.5x as long as a known name's wrong password, which told
    the names apart; the decoy is made like the hash most users have, and like the settings only
    when there are no users."""
    stronger = make_app(RELAY_ARGON2_TIME_COST=2, RELAY_ARGON2_MEMORY_COST=2048).test_client()
    wrong = {"password": "not the password"}
    assert stronger.post("/api/auth/login", json={"username": "nobody", **wrong}).status_code == 401
    auth.create_user("olga", "admin")  # m=1024, t=1, as the fixture's users are made
    for name in ("olga", "nobody", "Not A Name!"):
        assert stronger.post("/api/auth/login", json={"username": name, **wrong}).status_code == 401
    assert verified == [(2, 2048), (1, 1024), (1, 1024), (1, 1024)]


def test_a_refused_login_verifies_as_much_whoever_it_names(
    auth: AuthActions, db: psycopg.Connection, verified: list[tuple[int, int]]
) -> None:
    """Users whose hashes have other Argon2 parameters than most (made before RELAY_ARGON2_* changed, or
    from a shell without the web service's settings): an unknown name was verified like the most common
    hash only, so such a user's wrong password took measurably longer (115 ms against 4 ms), which told
    that the user exists. Every refusal now verifies a hash of each set of parameters stored."""
    for name in ("olga", "pete"):
        auth.create_user(name, "admin")  # m=1024, t=1: the most common
    users.create_user(db, "quinn", PASSWORD, "viewer", hasher=users.make_hasher(2, 2048, 1))
    work = {}
    for name in ("olga", "quinn", "nobody", "Not A Name!"):
        verified.clear()
        assert_problem(auth.login(name, "not the password"), 401, "login-failed")
        work[name] = sorted(verified)
    assert work == {name: [(1, 1024), (2, 2048)] for name in work}
    verified.clear()
    assert auth.login("quinn").status_code == 200
    assert verified == [(2, 2048)], "a password that matches costs its own hash alone"


@pytest.mark.parametrize(
    "edited_hash",
    [
        "$argon2id$v=19$m=1024,t=1,p=1$locked$locked",  # "locked" by hand: a salt too short to hash with
        "$argon2id$v=19$m=16,t=1,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo",  # too little memory for its lanes
    ],
)
def test_a_hash_edited_by_hand_never_makes_an_unknown_name_fail_differently(
    auth: AuthActions, db: psycopg.Connection, edited_hash: str
) -> None:
    """The decoy is made like the most common stored hash: one edited by hand to lock an account (the
    first user's, which wins ties) made an unknown name's login a 500, while a known one got a 401."""
    for name in ("root", "pat"):
        auth.create_user(name, "admin")
    db.execute("UPDATE relay.users SET password_hash = %s WHERE username = 'root'", (edited_hash,))
    for name in ("root", "pat", "nobody"):
        assert_problem(auth.login(name, "not the password"), 401, "login-failed")


def test_failed_logins_are_throttled_across_app_instances(make_app, auth: AuthActions) -> None:
    auth.create_user("ivan", "admin")
    settings = {"RELAY_LOGIN_MAX_FAILURES": 3, "RELAY_LOGIN_WINDOW_SECONDS": 600}
    first, second = make_app(**settings).test_client(), make_app(**settings).test_client()
    for client in (first, second, first):
        response = client.post("/api/auth/login", json={"username": "ivan", "password": "wrong password"})
        assert response.status_code == 401
    for client in (second, first):
        response = client.post("/api/auth/login", json={"username": "ivan", "password": PASSWORD})
        body = assert_problem(response, 429, "login-throttled")
        assert 590 <= int(response.headers["Retry-After"]) <= 600
        assert body["retry_after"] == int(response.headers["Retry-After"])


def test_a_successful_login_forgives_earlier_failures(make_app, auth: AuthActions) -> None:
    auth.create_user("judy", "admin")
    client = make_app(RELAY_LOGIN_MAX_FAILURES=3).test_client()
    for _ in range(2):
        client.post("/api/auth/login", json={"username": "judy", "password": "wrong password"})
    assert client.post("/api/auth/login", json={"username": "judy", "password": PASSWORD}).status_code == 200
    for _ in range(2):
        client.post("/api/auth/login", json={"username": "judy", "password": "wrong password"})
    assert client.post("/api/auth/login", json={"username": "judy", "password": PASSWORD}).status_code == 200


def test_throttle_counts_per_address_too(make_app, auth: AuthActions) -> None:
    client = make_app(RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS=3).test_client()
    for name in ("u1", "u2", "u3"):
        assert client.post("/api/auth/login", json={"username": name, "password": "guess-guess"}).status_code == 401
    assert_problem(client.post("/api/auth/login", json={"username": "u4", "password": "guess-guess"}), 429)


def _attempts_from(client, forwarded_for: str, n: int) -> list[int]:
    statuses = []
    for i in range(n):
        response = client.post(
            "/api/auth/login",
            json={"username": f"spray{i}", "password": "guess-guess"},
            headers={"X-Forwarded-For": forwarded_for},
            environ_base={"REMOTE_ADDR": "10.0.0.1"},
        )
        statuses.append(response.status_code)
    return statuses


def test_proxy_hops_decide_the_client_address(make_app, db: psycopg.Connection) -> None:
    behind_one_proxy = make_app(RELAY_PROXY_HOPS=1, RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS=2).test_client()
    # The client writes a fake address; the platform's proxy appends the real one.
    statuses = [_attempts_from(behind_one_proxy, f"198.51.100.{i}, 203.0.113.7", 1)[0] for i in range(3)]
    assert statuses == [401, 401, 429]
    keys = {row[0] for row in db.execute("SELECT key FROM relay.login_throttle WHERE key LIKE 'addr:%'")}
    assert keys == {"addr:203.0.113.7"}


def test_without_proxy_hops_forwarded_headers_are_ignored(make_app, db: psycopg.Connection) -> None:
    direct = make_app(RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS=2).test_client()
    assert _attempts_from(direct, "203.0.113.9", 3) == [401, 401, 429]
    keys = {row[0] for row in db.execute("SELECT key FROM relay.login_throttle WHERE key LIKE 'addr:%'")}
    assert keys == {"addr:10.0.0.1"}


def test_two_proxy_hops_take_the_second_entry_from_the_right(make_app, db: psycopg.Connection) -> None:
    client = make_app(RELAY_PROXY_HOPS=2).test_client()
    _attempts_from(client, "6.6.6.6, 192.0.2.44, 172.16.0.3", 1)
    keys = {row[0] for row in db.execute("SELECT key FROM relay.login_throttle WHERE key LIKE 'addr:%'")}
    assert keys == {"addr:192.0.2.44"}


def test_an_ipv6_client_is_counted_by_its_64(make_app, db: psycopg.Connection) -> None:
    """One IPv6 client holds a whole /64: counted address by address, each guess from it got a fresh limit."""
    client = make_app(RELAY_PROXY_HOPS=1, RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS=2).test_client()
    statuses = [_attempts_from(client, f"2001:db8:1:2::{i}", 1)[0] for i in range(1, 4)]
    assert statuses == [401, 401, 429]
    _attempts_from(client, "2001:db8:1:3:ffff::1", 1)
    _attempts_from(client, "::ffff:192.0.2.80", 1)
    # The same /64 and address written other ways (with a port a proxy appended): no new key.
    for same in ("2001:DB8:1:2::abc", "[2001:db8:1:2::9]:443", "192.0.2.80:8443"):
        _attempts_from(client, same, 1)
    keys = {row[0] for row in db.execute("SELECT key FROM relay.login_throttle WHERE key LIKE 'addr:%'")}
    assert keys == {"addr:2001:db8:1:2::/64", "addr:2001:db8:1:3::/64", "addr:192.0.2.80"}


def test_throttle_window_ends(make_app, auth: AuthActions) -> None:
    auth.create_user("mallory", "admin")
    client = make_app(RELAY_LOGIN_MAX_FAILURES=1, RELAY_LOGIN_WINDOW_SECONDS=1).test_client()
    client.post("/api/auth/login", json={"username": "mallory", "password": "wrong password"})
    assert client.post("/api/auth/login", json={"username": "mallory", "password": PASSWORD}).status_code == 429
    time.sleep(1.1)
    assert client.post("/api/auth/login", json={"username": "mallory", "password": PASSWORD}).status_code == 200


def test_parallel_guesses_cannot_slip_past_the_limit(make_app, auth: AuthActions) -> None:
    auth.create_user("oscar", "admin")
    app = make_app(RELAY_LOGIN_MAX_FAILURES=5, RELAY_WEB_POOL_SIZE=8)

    def guess(i: int) -> int:
        body = {"username": "oscar", "password": f"guess number {i}"}
        return app.test_client().post("/api/auth/login", json=body).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = sorted(pool.map(guess, range(24)))
    assert statuses == [401] * 5 + [429] * 19
