-- Users of the admin surface and the failed-login throttle (migration 0002).
-- Same format as queries.sql; relay_core/users.py runs them.

-- name: user_insert
-- Create a user; on a taken username insert nothing and return no row.
INSERT INTO relay.users (username, password_hash, role)
VALUES (%(username)s, %(password_hash)s, %(role)s)
ON CONFLICT (username) DO NOTHING
RETURNING id, username, role, created_at, password_changed_at, last_login_at;

-- name: user_get_for_login
-- The user a login names (all NULL when there is none, or no name) with the
-- hash to verify a password against, and one stored hash for each set of
-- Argon2 parameters the users' hashes have (split_part's fourth field is
-- "m=...,t=...,p="), the most common first, at most four: a refused login
-- verifies a decoy like each (see users.authenticate). One row always, so an
-- unknown name costs the same round trip as a known one.
SELECT u.id, u.username, u.role, u.password_hash, u.created_at, u.password_changed_at, u.last_login_at,
       (SELECT array_agg(kind_hash ORDER BY users DESC, first_id) FROM (
            SELECT min(password_hash) AS kind_hash, count(*) AS users, min(id) AS first_id
            FROM relay.users GROUP BY split_part(password_hash, '$', 4)
            ORDER BY users DESC, first_id LIMIT 4
        ) AS kinds) AS kind_hashes
FROM (SELECT) AS one
LEFT JOIN relay.users AS u ON u.username = %(username)s;

-- name: user_get
-- One user by id (token refresh re-reads the role and the password's age).
SELECT id, username, role, created_at, password_changed_at, last_login_at
FROM relay.users WHERE id = %(id)s;

-- name: user_list
-- Every user, by name.
SELECT id, username, role, created_at, password_changed_at, last_login_at
FROM relay.users ORDER BY username;

-- name: user_logged_in
-- A successful login; a new hash replaces the old one when the parameters
-- changed, but only if the stored hash is still the one that was verified, so
-- a password changed meanwhile is never overwritten.
UPDATE relay.users
SET last_login_at = now(),
    password_hash = CASE WHEN password_hash = %(verified_hash)s
                         THEN coalesce(%(new_hash)s, password_hash) ELSE password_hash END
WHERE id = %(id)s
RETURNING id;

-- name: user_set_password
-- A new password: refresh tokens issued before it stop working.
UPDATE relay.users SET password_hash = %(password_hash)s, password_changed_at = now()
WHERE username = %(username)s
RETURNING id;

-- name: user_set_role
-- Make a user an admin or a viewer.
UPDATE relay.users SET role = %(role)s WHERE username = %(username)s RETURNING id;

-- name: user_delete
-- Remove a user; their refresh tokens stop working at once.
DELETE FROM relay.users WHERE username = %(username)s RETURNING id;

-- name: login_throttle_hit
-- Count one login attempt against each key (sorted, so two logins lock rows
-- in the same order), starting a new window where the old one ended. Returns
-- each key's count and the seconds left in its window. Counting before the
-- password is checked means parallel guesses cannot slip past the limit.
INSERT INTO relay.login_throttle AS t (key, failures, window_started_at)
SELECT key, 1, now() FROM unnest(%(keys)s::text[]) AS k(key) ORDER BY key
ON CONFLICT (key) DO UPDATE
SET failures = CASE WHEN t.window_started_at <= now() - make_interval(secs => %(window_seconds)s::float8)
                    THEN 1 ELSE t.failures + 1 END,
    window_started_at = CASE WHEN t.window_started_at <= now() - make_interval(secs => %(window_seconds)s::float8)
                             THEN now() ELSE t.window_started_at END
RETURNING key, failures,
          extract(epoch FROM t.window_started_at + make_interval(secs => %(window_seconds)s::float8) - now())::float8
              AS seconds_left;

-- name: login_throttle_forgive
-- A successful login: its username starts afresh, and the attempt it counted
-- against the client address is taken back.
WITH cleared AS (
    DELETE FROM relay.login_throttle WHERE key = %(user_key)s RETURNING key
)
UPDATE relay.login_throttle SET failures = greatest(failures - 1, 0)
WHERE key = %(address_key)s
RETURNING key;

-- name: login_throttle_prune
-- Forget windows that ended long ago, a small batch at a time.
DELETE FROM relay.login_throttle
WHERE key IN (
    SELECT key FROM relay.login_throttle
    WHERE window_started_at < now() - make_interval(secs => 2 * %(window_seconds)s::float8)
    ORDER BY window_started_at
    LIMIT 100
    FOR UPDATE SKIP LOCKED
);

-- name: session_end
-- A dashboard session logged out: its tokens are refused from now on.
INSERT INTO relay.ended_sessions (session_id, expires_at)
VALUES (%(session_id)s, %(expires_at)s)
ON CONFLICT (session_id) DO NOTHING;

-- name: session_end_prune
-- Forget logged-out sessions past the time they would have ended anyway, a small batch at a time.
DELETE FROM relay.ended_sessions
WHERE session_id IN (
    SELECT session_id FROM relay.ended_sessions
    WHERE expires_at < now()
    ORDER BY expires_at
    LIMIT 100
    FOR UPDATE SKIP LOCKED
);

-- name: session_is_ended
-- Whether a dashboard session was logged out.
SELECT EXISTS (SELECT FROM relay.ended_sessions WHERE session_id = %(session_id)s) AS ended;
