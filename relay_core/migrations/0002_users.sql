-- Who may use Relay's admin surface, and the failed-login throttle.
-- No user ships with Relay: `relay user create` makes the first one.

CREATE TABLE relay.users (
    -- Identity, never reused: tokens name the user by it.
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Login name, stored lowercased so "Alice" and "alice" are one account.
    username            text NOT NULL UNIQUE CHECK (username ~ '^[a-z0-9_.@-]{1,150}$'),
    -- Argon2id PHC string; its parameters travel inside it, so a hash made with
    -- older parameters is recognised and replaced at the next successful login.
    password_hash       text NOT NULL CHECK (password_hash LIKE '$argon2id$%'),
    -- viewer reads; admin reads and acts (requeue, cancel, enqueue).
    role                text NOT NULL CHECK (role IN ('admin', 'viewer')),
    created_at          timestamptz NOT NULL DEFAULT now(),
    -- Refresh tokens issued before this moment are refused: a new password ends old sessions.
    password_changed_at timestamptz NOT NULL DEFAULT now(),
    last_login_at       timestamptz
);

-- Failed logins, per username and per client address, shared by every web
-- process (a throttle in one process's memory is no throttle behind a load
-- balancer). One row per throttled key: 'user:<name>' or 'addr:<ip>'.
CREATE TABLE relay.login_throttle (
    key               text PRIMARY KEY,
    -- Attempts counted in the current window (a successful login forgives its own).
    failures          integer NOT NULL,
    -- The window starts at the first counted attempt and lasts the configured seconds.
    window_started_at timestamptz NOT NULL
) WITH (
    -- Every login updates a row here: vacuum eagerly, keep room for HOT updates.
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.05
);

-- Expired windows are pruned in small batches, oldest first.
CREATE INDEX login_throttle_window_idx ON relay.login_throttle (window_started_at);
