"""Dashboard login, logout, sessions, roles and CSRF."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import jwt
import psycopg
import pytest
from flask import Flask
from flask_jwt_extended import create_access_token
from werkzeug.test import EnvironBuilder, run_wsgi_app

from relay_core import ConfigurationError, users

from .conftest import DashboardClient, Jobs, make_user, page_csrf

PAGES = ["/", "/jobs", "/jobs?state=dead", "/dead", "/queues", "/workers", "/schedules"]


def _cookie(response, name: str = "access_token_cookie") -> str:
    for header in response.headers.getlist("Set-Cookie"):
        if header.startswith(name + "="):
            return header
    raise AssertionError(f"no {name} cookie set: {response.headers.getlist('Set-Cookie')}")


@pytest.mark.parametrize("path", PAGES)
def test_pages_send_strangers_to_login(anonymous: DashboardClient, path: str) -> None:
    response = anonymous.get(path)
    assert response.status_code == 303
    assert response.headers["Location"].startswith("/login?next=")


def test_htmx_request_without_session_redirects_the_whole_page(anonymous: DashboardClient) -> None:
    response = anonymous.get("/", htmx=True)
    assert response.status_code == 401
    assert response.headers["HX-Redirect"].startswith("/login")


def test_an_action_after_the_session_ended_returns_to_the_page_after_login(
    anonymous: DashboardClient, jobs: Jobs, dsn: str
) -> None:
    # The person read the dead job's page for longer than a session lasts, then pressed Requeue.
    make_user(dsn, "ops", "admin")
    job_id = jobs.dead(jobs.add())
    page = f"http://localhost/jobs/{job_id}"
    htmx = anonymous.client.post(
        f"/jobs/{job_id}/requeue", headers={"HX-Request": "true", "HX-Current-URL": page, "Referer": page}
    )
    assert htmx.status_code == 401
    assert htmx.headers["HX-Redirect"] == f"/login?next=/jobs/{job_id}&undone=1"
    form = anonymous.client.post(f"/jobs/{job_id}/requeue", headers={"Referer": page})
    assert form.status_code == 303
    assert form.headers["Location"] == f"/login?next=/jobs/{job_id}&undone=1"
    poll = anonymous.client.get(
        f"/jobs/{job_id}?part=status&seen=queued", headers={"HX-Request": "true", "HX-Current-URL": page}
    )
    assert poll.headers["HX-Redirect"] == f"/login?next=/jobs/{job_id}"
    assert jobs.status(job_id) == "dead"  # nothing was done without a session
    login = anonymous.get(htmx.headers["HX-Redirect"]).get_data(as_text=True)
    assert f'name="next" value="/jobs/{job_id}"' in login
    # The form says the press was not done: a bare form let the person think the requeue went through.
    assert "Your session had ended, so what you pressed was not done. Log in, then press it again." in login
    assert "what you pressed" not in anonymous.get(poll.headers["HX-Redirect"]).get_data(as_text=True)
    assert anonymous.login("ops", next=f"/jobs/{job_id}").headers["Location"] == f"/jobs/{job_id}"


def test_a_page_of_another_site_is_never_the_way_back(anonymous: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    response = anonymous.client.post(
        f"/jobs/{job_id}/requeue",
        headers={
            "HX-Request": "true",
            "HX-Current-URL": "https://evil.example.com/x",
            "Referer": "https://evil.example.com/x",
        },
    )
    assert response.headers["HX-Redirect"] == "/login?undone=1"  # a POST: the form says it was not done


def test_login_sets_an_httponly_samesite_cookie_and_goes_to_next(anonymous: DashboardClient, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    response = anonymous.login("ops", next="/dead")
    assert response.status_code == 303
    assert response.headers["Location"] == "/dead"
    cookie = _cookie(response)
    assert "HttpOnly" in cookie
    assert "SameSite=Lax" in cookie
    assert "Secure" not in cookie  # plain http in tests
    assert anonymous.get("/dead").status_code == 200


def test_the_cookie_keeps_the_samesite_the_settings_give(app: Flask, make_app, dsn: str) -> None:
    """The settings said Strict while every cookie went out Lax: a deployment that chose Strict
    (JWT_COOKIE_SAMESITE, as flask-jwt-extended names it) got Lax without a word."""
    assert app.config["JWT_COOKIE_SAMESITE"] == "Lax"
    make_user(dsn, "ops", "admin")
    client = DashboardClient(make_app(JWT_COOKIE_SAMESITE="Strict").test_client(), dsn)
    assert "SameSite=Strict" in _cookie(client.login("ops"))
    assert "SameSite=Strict" in _cookie(client.post("/logout", htmx=False))


@pytest.mark.parametrize("samesite", ["None", "lax", "", None])
def test_a_samesite_the_dashboard_cannot_keep_stops_the_app_at_start(make_app, samesite: object) -> None:
    with pytest.raises(ConfigurationError, match="JWT_COOKIE_SAMESITE"):
        make_app(JWT_COOKIE_SAMESITE=samesite)


def test_cookie_is_secure_over_https(app: Flask, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    client = app.test_client()
    response = client.post(
        "/login", data={"username": "ops", "password": "correct horse battery"}, base_url="https://relay.example.com"
    )
    assert response.status_code == 303
    assert "; Secure" in _cookie(response)


def test_login_never_redirects_off_site(anonymous: DashboardClient, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    # A tab, newline or other control character in the path is dropped on the way to the Location
    # header, so "/<TAB>/evil" would leave as "//evil".
    for target in (
        "//evil.example.com/",
        "https://evil.example.com/",
        "/\\evil.example.com",
        "/\t/evil.example.com/phish",
        "/\n/evil.example.com",
        "/\r\n/evil.example.com",
        "/ /evil.example.com",
        "/\x7f/evil.example.com",
    ):
        response = anonymous.login("ops", next=target)
        assert response.headers["Location"] == "/", target


def test_wrong_password_is_refused_without_a_cookie(anonymous: DashboardClient, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    response = anonymous.login("ops", "wrong password!")
    assert response.status_code == 401
    assert "Wrong username or password." in response.get_data(as_text=True)
    assert "access_token_cookie" not in " ".join(response.headers.getlist("Set-Cookie"))
    assert anonymous.get("/").status_code == 303


def test_login_is_throttled_like_the_api(make_app, dsn: str) -> None:
    app = make_app(RELAY_LOGIN_MAX_FAILURES=2)
    make_user(dsn, "ops", "admin")
    client = DashboardClient(app.test_client(), dsn)
    assert client.login("ops", "wrong password 1").status_code == 401
    assert client.login("ops", "wrong password 2").status_code == 401
    response = client.login("ops")
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) > 0
    assert "Too many attempts" in response.get_data(as_text=True)


@pytest.mark.parametrize(("username", "password"), [("o\x00ps", "correct horse battery"), ("ops", "correct\x00horse")])
def test_login_with_nul_is_refused_clearly_and_not_counted(
    anonymous: DashboardClient, dsn: str, db: psycopg.Connection, username: str, password: str
) -> None:
    # As POST /api/auth/login: PostgreSQL text cannot hold NUL, and no password can contain one.
    make_user(dsn, "ops", "admin")
    response = anonymous.login(username, password)
    assert response.status_code == 422
    assert "must not contain NUL characters" in response.get_data(as_text=True)
    assert "access_token_cookie" not in " ".join(response.headers.getlist("Set-Cookie"))
    assert db.execute("SELECT count(*) FROM relay.login_throttle").fetchone()[0] == 0


def _chunked_login(app: Flask, body: bytes) -> tuple[str, dict[str, str]]:
    """POST the login form without Content-Length, as gunicorn hands a chunked request to the app."""
    environ = EnvironBuilder(
        path="/login",
        method="POST",
        input_stream=io.BytesIO(body),
        headers={"Content-Type": "application/x-www-form-urlencoded", "Transfer-Encoding": "chunked"},
    ).get_environ()
    del environ["CONTENT_LENGTH"]
    environ["wsgi.input_terminated"] = True
    _, status, headers = run_wsgi_app(app, environ, buffered=True)
    return status, dict(headers)


def test_an_oversized_chunked_login_form_is_413_not_read_cut_short(app: Flask, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    form = b"username=ops&password=correct+horse+battery&next=/dead"
    status, headers = _chunked_login(app, form + b"&pad=" + b"x" * (2 * 1024 * 1024))
    assert status.startswith("413")
    assert "access_token_cookie" not in headers.get("Set-Cookie", "")
    status, headers = _chunked_login(app, form)
    assert status.startswith("303") and headers["Location"] == "/dead"


def test_login_form_from_another_site_is_refused(anonymous: DashboardClient, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    response = anonymous.client.post(
        "/login",
        data={"username": "ops", "password": "correct horse battery"},
        headers={"Origin": "https://evil.example.com"},
    )
    assert response.status_code == 403
    assert "access_token_cookie" not in " ".join(response.headers.getlist("Set-Cookie"))


def test_logout_needs_the_csrf_token_and_ends_the_session(admin: DashboardClient) -> None:
    assert admin.client.get("/logout").status_code == 405  # never over GET
    refused = admin.post("/logout", htmx=False, csrf=False)
    assert refused.status_code == 403
    assert admin.get("/").status_code == 200
    response = admin.post("/logout", htmx=False)
    assert response.status_code == 303
    assert response.headers["Location"] == "/login"
    assert "access_token_cookie=;" in _cookie(response)
    assert admin.get("/").status_code == 303


def test_a_copy_of_the_cookie_stops_working_when_its_session_logs_out(
    app: Flask, admin: DashboardClient, jobs: Jobs, dsn: str
) -> None:
    """Logout ends the session on the server, not only in the browser that logged out."""
    job_id = jobs.add()
    cookie = admin.client.get_cookie("access_token_cookie")
    assert cookie is not None
    copy = DashboardClient(app.test_client(), dsn)
    copy.client.set_cookie("access_token_cookie", cookie.value)
    copy.csrf = admin.csrf
    assert copy.get("/").status_code == 200, "the copy works while the session lasts"
    assert (
        app.test_client().get("/api/admin/jobs", headers={"Authorization": f"Bearer {cookie.value}"}).status_code == 200
    )
    assert admin.post("/logout", htmx=False).status_code == 303
    assert copy.get("/").status_code == 303, "the copied cookie leads to the login page"
    assert copy.post(f"/jobs/{job_id}/cancel").status_code in (303, 401), "and acts on nothing"
    assert jobs.status(job_id) == "queued"
    api = app.test_client().get("/api/admin/jobs", headers={"Authorization": f"Bearer {cookie.value}"})
    assert api.status_code == 401 and api.mimetype == "application/problem+json"
    assert api.get_json()["type"] == "urn:relay:problem:session-ended"
    assert "(logged out)" in api.get_json()["detail"]
    again = DashboardClient(app.test_client(), dsn)
    assert again.login("admin").status_code == 303 and again.get("/").status_code == 200, "a new login works"


def test_an_api_token_in_the_cookie_is_not_a_dashboard_session(app: Flask, dsn: str) -> None:
    make_user(dsn, "ops", "admin")
    client = app.test_client()
    token = client.post("/api/auth/login", json={"username": "ops", "password": "correct horse battery"}).get_json()
    client.set_cookie("access_token_cookie", token["access_token"])
    assert client.get("/").status_code == 303


def test_a_deleted_user_is_logged_out_at_once(admin: DashboardClient, dsn: str) -> None:
    assert admin.get("/").status_code == 200
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.delete_user(conn, "admin")
    assert admin.get("/").status_code == 303


def test_a_changed_password_ends_the_session(admin: DashboardClient, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.set_password(conn, "admin", "a brand new password", hasher=users.make_hasher(1, 1024, 1))
    assert admin.get("/").status_code == 303


def test_a_demoted_admin_loses_the_buttons_and_the_actions_at_once(
    app: Flask, admin: DashboardClient, jobs: Jobs, dsn: str
) -> None:
    job_id = jobs.dead(jobs.add())
    assert "Requeue</button>" in admin.get(f"/jobs/{job_id}").get_data(as_text=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.set_role(conn, "admin", "viewer")
    assert "Requeue</button>" not in admin.get(f"/jobs/{job_id}").get_data(as_text=True)
    assert admin.post(f"/jobs/{job_id}/requeue").status_code == 403
    # The session's cookie sent to the API as a bearer token: the role it carries is not the user's any more.
    cookie = admin.client.get_cookie("access_token_cookie")
    assert cookie is not None
    bearer = {"Authorization": f"Bearer {cookie.value}"}
    api = app.test_client().post(f"/api/admin/jobs/{job_id}/requeue", headers=bearer)
    assert api.status_code == 403, api.get_json()
    assert app.test_client().get("/api/admin/jobs", headers=bearer).status_code == 200
    assert jobs.status(job_id) == "dead"
    with psycopg.connect(dsn, autocommit=True) as conn:
        users.delete_user(conn, "admin")
    removed = app.test_client().get("/api/admin/jobs", headers=bearer)
    assert removed.status_code == 401, removed.get_json()
    # As an API token of a removed user is answered (docs/api.md), not as a token that is malformed.
    assert removed.get_json()["type"] == "urn:relay:problem:session-ended"


def _session_token(
    app: Flask, user: users.User, csrf: str, *, age: float, logged_in_ago: float, auth_time: object = None
) -> str:
    """A dashboard session's token, signed as Relay signs it; ``auth_time`` replaces the login time Relay writes."""
    with app.app_context():
        now = time.time()
        return create_access_token(
            identity=str(user.id),
            expires_delta=timedelta(seconds=app.config["RELAY_ACCESS_TOKEN_SECONDS"]),
            additional_claims={
                "role": user.role,
                "username": user.username,
                "pwd": user.password_changed_at.isoformat(),
                "auth_time": int(now - logged_in_ago) if auth_time is None else auth_time,
                "iat": int(now - age),
                "nbf": int(now - age),
                "csrf": csrf,
            },
        )


def test_an_active_session_slides_keeping_its_csrf_token(app: Flask, dsn: str) -> None:
    user = make_user(dsn, "ops", "admin")
    client = app.test_client()
    client.set_cookie("access_token_cookie", _session_token(app, user, "csrf-1", age=600, logged_in_ago=600))
    response = client.get("/")
    assert response.status_code == 200
    renewed = _cookie(response)
    client.set_cookie("access_token_cookie", renewed.split(";")[0].split("=", 1)[1])
    page = client.get("/jobs")
    assert page_csrf(page.get_data(as_text=True)) == "csrf-1"
    assert "Set-Cookie" not in page.headers  # fresh again: no renewal needed


def test_a_session_lasts_its_access_lifetime_from_the_last_request(app: Flask, dsn: str) -> None:
    """Renewed only past half its life, a token two minutes old was kept: the session ended 13 minutes after
    that request, where the dashboard's guide promises 15 (and an idle one could end after 7.5)."""
    user = make_user(dsn, "ops", "admin")
    access = app.config["RELAY_ACCESS_TOKEN_SECONDS"]
    client = app.test_client()
    client.set_cookie("access_token_cookie", _session_token(app, user, "c", age=120, logged_in_ago=120))
    response = client.get("/")
    assert response.status_code == 200
    claims = jwt.decode(_cookie(response).split(";")[0].split("=", 1)[1], options={"verify_signature": False})
    assert access - 5 <= claims["exp"] - time.time() <= access
    young = app.test_client()
    young.set_cookie("access_token_cookie", _session_token(app, user, "c", age=30, logged_in_ago=30))
    assert "Set-Cookie" not in young.get("/").headers  # under a minute old: kept


def test_a_session_ends_after_the_refresh_lifetime_however_active(app: Flask, dsn: str) -> None:
    user = make_user(dsn, "ops", "admin")
    client = app.test_client()
    longest = app.config["RELAY_REFRESH_TOKEN_SECONDS"]
    token = _session_token(app, user, "c", age=10, logged_in_ago=longest + 5)
    client.set_cookie("access_token_cookie", token)
    assert client.get("/").status_code == 303
    # The same token sent to the API as a bearer token: the session is over there too.
    api = app.test_client().get("/api/admin/jobs", headers={"Authorization": f"Bearer {token}"})
    assert api.status_code == 401, api.get_json()
    assert api.get_json()["type"] == "urn:relay:problem:session-ended"


@pytest.mark.parametrize(
    "auth_time",
    ["yesterday", "nan", float("nan"), float("inf"), True, [1], 4102444800],
    ids=["word", "nan-text", "nan", "infinity", "boolean", "list", "a-login-in-2100"],
)
def test_a_signed_session_token_whose_login_time_relay_never_writes_is_refused(
    app: Flask, dsn: str, auth_time: object
) -> None:
    """Signed with the app's key, but its login time is no past moment: the API answered 500
    (``float()`` of the text), and NaN, infinity or a future time made a session that never ends."""
    user = make_user(dsn, "ops", "admin")
    token = _session_token(app, user, "c", age=10, logged_in_ago=0, auth_time=auth_time)
    api = app.test_client().get("/api/admin/jobs", headers={"Authorization": f"Bearer {token}"})
    assert api.status_code == 401, api.get_data(as_text=True)
    assert api.get_json()["type"] == "urn:relay:problem:token-invalid"
    client = app.test_client()
    client.set_cookie("access_token_cookie", token)
    page = client.get("/")
    assert page.status_code == 303 and "/login" in page.headers["Location"]


def test_a_renewed_session_token_expires_when_the_session_must_end(app: Flask, dsn: str) -> None:
    user = make_user(dsn, "ops", "admin")
    client = app.test_client()
    access, longest = app.config["RELAY_ACCESS_TOKEN_SECONDS"], app.config["RELAY_REFRESH_TOKEN_SECONDS"]
    assert longest > access
    ended_in = access / 4  # the session has less left than a full access lifetime
    token = _session_token(app, user, "c", age=access, logged_in_ago=longest - ended_in)
    client.set_cookie("access_token_cookie", token)
    response = client.get("/")
    assert response.status_code == 200
    renewed = _cookie(response).split(";")[0].split("=", 1)[1]
    claims = jwt.decode(renewed, options={"verify_signature": False})
    assert claims["exp"] <= claims["auth_time"] + longest
    assert claims["exp"] - time.time() <= ended_in + 1


def test_state_changing_posts_need_the_csrf_token(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    missing = admin.post(f"/jobs/{job_id}/requeue", csrf=False)
    assert missing.status_code == 403
    assert "security token" in missing.get_data(as_text=True)
    admin_csrf = admin.csrf
    admin.csrf = "not-the-token"
    page = f"http://localhost/jobs/{job_id}"
    refused = admin.client.post(
        f"/jobs/{job_id}/requeue",
        headers={"HX-Request": "true", "HX-Current-URL": page, "X-CSRF-TOKEN": admin.csrf},
    )
    assert refused.status_code == 403
    html = refused.get_data(as_text=True)
    # The way on is reloading the page the token came from, not the login form offered to someone logged in.
    assert f'<a class="btn" href="/jobs/{job_id}">Reload the page</a>' in html and "Log in" not in html
    admin.csrf = admin_csrf
    assert jobs.status(job_id) == "dead"


def test_a_csrf_token_that_is_not_ascii_is_refused_as_any_wrong_one(admin: DashboardClient, jobs: Jobs) -> None:
    """flask-jwt-extended's comparison raised TypeError for a non-ASCII token: a 500 and a
    traceback in the log, where a wrong token gets the 403 that says to reload the page."""
    job_id = jobs.dead(jobs.add())
    by_form = admin.client.post(f"/jobs/{job_id}/requeue", data={"csrf_token": "\u00e9"})
    by_header = admin.client.post(
        f"/jobs/{job_id}/requeue", headers={"HX-Request": "true", "X-CSRF-TOKEN": "\u00c3\u00a9"}
    )
    for refused in (by_form, by_header):
        assert refused.status_code == 403
        assert "security token" in refused.get_data(as_text=True)
    assert jobs.status(job_id) == "dead"


def test_a_form_field_csrf_token_works_without_htmx(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    response = admin.post(f"/jobs/{job_id}/requeue", htmx=False)
    assert response.status_code == 303
    assert response.headers["Location"] == f"/jobs/{job_id}"
    assert jobs.status(job_id) == "queued"


def test_a_post_from_another_origin_is_refused_even_with_the_token(admin: DashboardClient, jobs: Jobs) -> None:
    job_id = jobs.dead(jobs.add())
    response = admin.client.post(
        f"/jobs/{job_id}/requeue",
        headers={"X-CSRF-TOKEN": admin.csrf, "HX-Request": "true", "Origin": "https://evil.example.com"},
    )
    assert response.status_code == 403
    assert jobs.status(job_id) == "dead"


def test_viewers_forged_posts_are_refused_and_change_nothing(viewer: DashboardClient, jobs: Jobs, relay) -> None:
    dead = jobs.dead(jobs.add())
    queued = jobs.add(queue="mail")
    for url, data in [
        (f"/jobs/{dead}/requeue", None),
        (f"/jobs/{queued}/cancel", None),
        ("/dead/requeue", {"type": "send_email"}),
        ("/queues/mail/pause", None),
    ]:
        response = viewer.post(url, data)
        assert response.status_code == 403, url
        assert "you are a viewer" in response.get_data(as_text=True)
    assert jobs.status(dead) == "dead"
    assert jobs.status(queued) == "queued"
    assert relay.paused_queues() == []


def test_viewers_see_no_action_buttons(viewer: DashboardClient, jobs: Jobs) -> None:
    dead = jobs.dead(jobs.add())
    queued = jobs.add()
    for url in (f"/jobs/{dead}", f"/jobs/{queued}", "/dead", "/queues"):
        html = viewer.get(url).get_data(as_text=True)
        assert "<button" in html  # the logout button only
        assert html.count("<button") == 1, url
        assert "hx-post" not in html, url


def test_a_logout_after_the_session_ended_does_not_say_a_press_was_not_done(anonymous: DashboardClient) -> None:
    """The login form's "what you pressed was not done" is for actions; logging out is done either way."""
    response = anonymous.client.post("/logout", headers={"HX-Request": "true"})
    assert response.status_code == 401
    assert response.headers["HX-Redirect"] == "/login"
