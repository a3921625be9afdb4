-- job_events: record every job change, once per statement: its row in job_events, and its
-- user in the transaction's wake-up list that job_notify.sql turns into one NOTIFY at commit.
--
-- What counts as a change: an insert, and an update that moves status, deleted_at, or a queued
-- job's wait. Kinds (analysis_queue.models.EventKind): admitted (insert), deleted (deleted_at
-- set; the job keeps its final status), waiting (a queued job's wait changed), promoted
-- (-> pending), started (-> running), finished (-> succeeded | failed), cancelled
-- (-> cancelled), changed (any other move, e.g. a manual fix). Bookkeeping updates (claims,
-- attempts, polls) are no change: they write no event and wake nobody.
--
-- Ids are per user, dense and in commit order: the statement adds its count of the user's
-- changes to the user's counter row (inserted on first use), which holds that row's lock until
-- commit, so the user's next event-writing transaction takes its ids only after this one
-- committed, and a rollback gives them back. Within a statement a user's events follow
-- admission order (queue_seq). The counter row is the last lock its writer takes, and a
-- statement over several users takes their counters sorted (docs/locking.md).
--
-- Statement-level, with transition tables: a statement that changes n jobs costs two
-- statements here, not 3n (a row trigger paid an UPDATE and an INSERT per row, each prepared on
-- its own, and a second trigger call for the wake-up list: docs/benchmarks.md). Transition
-- tables cannot name columns, so every UPDATE of analysis_jobs fires this; one that changes
-- nothing costs the query that finds so.

-- The row triggers this replaced, dropped in the transaction that creates their successor, so
-- no change goes unrecorded between the two. Migration 0015 keeps an older instance restarting
-- during the roll from putting them back (docs/operations.md).
DROP TRIGGER IF EXISTS analysis_jobs_event_insert_v2 ON analysis_jobs;
DROP TRIGGER IF EXISTS analysis_jobs_event_update_v2 ON analysis_jobs;
DROP TRIGGER IF EXISTS analysis_jobs_notice_insert_v1 ON analysis_jobs;
DROP TRIGGER IF EXISTS analysis_jobs_notice_update_v1 ON analysis_jobs;
DROP FUNCTION IF EXISTS aq_job_event_v2();
DROP FUNCTION IF EXISTS aq_job_notice_v1();

-- A job's change as an event kind (analysis_queue.models.EventKind), from its status and
-- deleted_at before (both NULL: inserted) and after. Inlined where it is called.
CREATE OR REPLACE FUNCTION aq_change_kind_v1(
    p_was text, p_was_deleted timestamptz, p_status text, p_deleted timestamptz)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN p_was IS NULL THEN 'admitted'
        WHEN p_deleted IS NOT NULL AND p_was_deleted IS NULL THEN 'deleted'
        WHEN p_status = p_was AND p_status = 'queued' THEN 'waiting'
        ELSE CASE p_status
            WHEN 'pending' THEN 'promoted'
            WHEN 'running' THEN 'started'
            WHEN 'succeeded' THEN 'finished'
            WHEN 'failed' THEN 'finished'
            WHEN 'cancelled' THEN 'cancelled'
            ELSE 'changed' END
    END
$$;

-- Whether the same change may leave work for someone ('1', else '0'): the job left
-- pending/running (finished, or deleted), or became pending. Inlined where it is called.
CREATE OR REPLACE FUNCTION aq_change_wakes_v1(
    p_was text, p_was_deleted timestamptz, p_status text, p_deleted timestamptz)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN (p_was IN ('pending', 'running')
                      AND (p_status NOT IN ('pending', 'running')
                           OR (p_deleted IS NOT NULL AND p_was_deleted IS NULL)))
                     OR (p_status = 'pending' AND p_was IS DISTINCT FROM 'pending')
                THEN '1' ELSE '0' END
$$;

-- Move each user's event counter (p_users sorted, distinct) by their count of new events,
-- creating it on first use; returns the counters after, in p_users' order. The rows stay locked
-- until commit: the last lock an event writer takes (docs/locking.md).
CREATE OR REPLACE FUNCTION aq_count_events_v1(p_users text[], p_counts integer[])
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_last bigint[];
BEGIN
    IF cardinality(p_users) = 1 THEN
        UPDATE job_event_counters k SET last_id = k.last_id + p_counts[1]
         WHERE k.user_id = p_users[1]
        RETURNING ARRAY[k.last_id] INTO v_last;
    END IF;
    IF v_last IS NULL THEN  -- several users, or a first event
        WITH u AS (
            INSERT INTO job_event_counters AS k (user_id, last_id)
            SELECT c.u, c.n FROM unnest(p_users, p_counts) AS c(u, n) ORDER BY c.u
            ON CONFLICT (user_id) DO UPDATE SET last_id = k.last_id + EXCLUDED.last_id
            RETURNING k.user_id, k.last_id)
        SELECT array_agg(u.last_id ORDER BY u.user_id) INTO v_last FROM u;
    END IF;
    RETURN v_last;
END
$$;

-- Add p_users, each with its wake, to the transaction's wake-up list. The list (the setting
-- aq.changed, transaction-local) is plain text, so that adding to it costs a string search, not
-- a JSON parse: the epoch of the transaction's first change, then
-- one entry per user and wake, E'\x1f' || wake || user id || E'\x1f'. Wake is 1 when a change
-- may leave work for someone (a job left pending/running, or became pending), else 0; a user
-- who woke after a change that did not appears twice, and the note takes the larger. User ids
-- hold no control characters (http/auth.py), so an entry is found only where it starts. Past
-- 7,500 bytes the note could not be smaller: the list becomes the epoch and E'\x1f\x1e', the
-- overflow, and takes no more entries.
CREATE OR REPLACE FUNCTION aq_note_changed_v1(p_users text[], p_wakes text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_list text := coalesce(current_setting('aq.changed', true), '');
    v_add text := '';
BEGIN
    IF right(v_list, 1) = E'\x1e' THEN
        RETURN;  -- overflowed: listeners re-read everything
    END IF;
    FOR i IN 1 .. cardinality(p_users) LOOP
        CONTINUE WHEN strpos(v_list, E'\x1f1' || p_users[i] || E'\x1f') > 0
                   OR (p_wakes[i] = '0' AND strpos(v_list, E'\x1f0' || p_users[i] || E'\x1f') > 0);
        v_add := v_add || E'\x1f' || p_wakes[i] || p_users[i] || E'\x1f';
    END LOOP;
    IF v_add = '' THEN
        RETURN;  -- the list says so already
    END IF;
    IF v_list = '' THEN
        v_list := extract(epoch FROM clock_timestamp())::text;
    END IF;
    v_list := v_list || v_add;
    IF octet_length(v_list) > 7500 THEN
        v_list := split_part(v_list, E'\x1f', 1) || E'\x1f\x1e';
    END IF;
    PERFORM set_config('aq.changed', v_list, true);
END
$$;

-- The trigger function: the statement's changes, their events with ids from each user's
-- counter (aq_count_events_v1), and their users added to the wake-up list
-- (aq_note_changed_v1).
CREATE OR REPLACE FUNCTION aq_job_changes_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    -- The statement's changes, sorted by user, then admission order; and their event ids.
    v_users text[];
    v_jobs uuid[];
    v_kinds text[];
    v_wakes text[];
    v_ids bigint[] := '{}';
    -- Per user (sorted): the count of changes, the larger wake, and the counter after them.
    v_user text[] := '{}';
    v_count integer[] := '{}';
    v_wake text[] := '{}';
    v_last bigint[];
    v_id bigint;
    d integer := 0;
BEGIN
    IF TG_OP = 'INSERT' THEN
        SELECT array_agg(c.user_id), array_agg(c.id), array_agg(c.kind), array_agg(c.wake)
          INTO v_users, v_jobs, v_kinds, v_wakes
          FROM (SELECT n.user_id, n.id,
                       aq_change_kind_v1(NULL, NULL, n.status, n.deleted_at) AS kind,
                       aq_change_wakes_v1(NULL, NULL, n.status, n.deleted_at) AS wake
                  FROM aq_new n
                 ORDER BY n.user_id, n.queue_seq) c;
    ELSE
        SELECT array_agg(c.user_id), array_agg(c.id), array_agg(c.kind), array_agg(c.wake)
          INTO v_users, v_jobs, v_kinds, v_wakes
          FROM (SELECT n.user_id, n.id,
                       aq_change_kind_v1(o.status, o.deleted_at, n.status, n.deleted_at) AS kind,
                       aq_change_wakes_v1(o.status, o.deleted_at, n.status, n.deleted_at) AS wake
                  FROM aq_new n JOIN aq_old o ON o.id = n.id
                 WHERE o.status IS DISTINCT FROM n.status
                    OR o.deleted_at IS DISTINCT FROM n.deleted_at
                    OR (n.status = 'queued' AND o.waiting_for IS DISTINCT FROM n.waiting_for)
                 ORDER BY n.user_id, n.queue_seq) c;
    END IF;
    IF v_users IS NULL THEN
        RETURN NULL;
    END IF;
    -- Simple expressions from here to the counter (no query each): the users, their counts
    -- and wakes, from the sorted changes.
    FOR i IN 1 .. cardinality(v_users) LOOP
        IF d = 0 OR v_user[d] <> v_users[i] THEN
            d := d + 1;
            v_user[d] := v_users[i];
            v_count[d] := 0;
            v_wake[d] := '0';
        END IF;
        v_count[d] := v_count[d] + 1;
        v_wake[d] := greatest(v_wake[d], v_wakes[i]);
    END LOOP;

    -- Each user's events take the ids below their counter after them.
    v_last := aq_count_events_v1(v_user, v_count);
    d := 0;
    FOR i IN 1 .. cardinality(v_users) LOOP
        IF d = 0 OR v_user[d] <> v_users[i] THEN
            d := d + 1;
            v_id := v_last[d] - v_count[d];
        END IF;
        v_id := v_id + 1;
        v_ids[i] := v_id;
    END LOOP;
    INSERT INTO job_events (user_id, event_id, job_id, kind, created_at)
    SELECT e.u, e.id, e.j, e.k, clock_timestamp()
      FROM unnest(v_users, v_ids, v_jobs, v_kinds) AS e(u, id, j, k);

    PERFORM aq_note_changed_v1(v_user, v_wake);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER analysis_jobs_changes_insert_v1
    AFTER INSERT ON analysis_jobs
    REFERENCING NEW TABLE AS aq_new
    FOR EACH STATEMENT EXECUTE FUNCTION aq_job_changes_v1();

CREATE OR REPLACE TRIGGER analysis_jobs_changes_update_v1
    AFTER UPDATE ON analysis_jobs
    REFERENCING OLD TABLE AS aq_old NEW TABLE AS aq_new
    FOR EACH STATEMENT EXECUTE FUNCTION aq_job_changes_v1();
