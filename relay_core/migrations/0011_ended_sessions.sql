-- Dashboard sessions logged out before they ran out. A session's JWT lives in
-- its cookie and slides (each renewal keeps the session's CSRF value), so
-- deleting the cookie ended the session only in the browser that logged out: a
-- copy of the cookie kept working, on the dashboard and as an API bearer
-- token, until the refresh-token lifetime since login had passed. Logout now
-- records the session here, and every check of a session's token reads it.
-- A row is needed only until the session would have ended anyway; each
-- logout prunes the rows past that.
CREATE TABLE relay.ended_sessions (
    -- SHA-256 (hex) of the session's CSRF value: the one claim every token of a session shares.
    session_id text PRIMARY KEY,
    -- When the session would have ended anyway (its login plus the refresh-token lifetime).
    expires_at timestamptz NOT NULL
);
