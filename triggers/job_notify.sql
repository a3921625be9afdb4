-- job_notify: wake every instance, once per transaction, when jobs are inserted or change
-- status, deletion or wait.
--
-- Every notifying commit takes PostgreSQL's cluster-wide NOTIFY lock, so a transaction that
-- changes many jobs (a batch of admits, of completions, of running marks) sends one notification
-- for all of them: each change adds its user to a transaction-local list (the setting
-- aq.changed, set_config(..., true)), and a deferred trigger turns the list into the note at
-- commit. Every deferred firing of the transaction sends the same text, which PostgreSQL folds
-- into one notification.
--
-- Channel aq_jobs_v2. Payload (JSON, under 7,500 bytes whatever the transaction changed;
-- analysis_queue.models.ChangeNotice reads it):
--   {"v": 2, "at": epoch seconds of the transaction's first change,
--    "u": {user id: 1 if a change of theirs may leave work (a job left pending/running, or
--          became pending), else 0, ...}}
-- or, when the users would not fit, {"v": 2, "at": ..., "overflow": true}: listeners then
-- re-read everything (the catch-up they do after a reconnect).
-- NOTIFY is a wake-up hint only: listeners read the jobs and events of the users it names.
-- Only status, deleted_at and a queued job's wait notify: bookkeeping updates (claims,
-- attempts, polls) must not flood the channel. Fires on exactly what job_events.sql logs, so
-- every committed event comes with a wake-up.
--
-- The list is plain text, so that a changed row costs a string search, not a JSON parse:
-- the first change's epoch, then one entry per user and wake, E'\x1f' || wake || user id ||
-- E'\x1f' (a user who woke after a change that did not appears twice; the note takes the
-- larger). User ids hold no control characters (http/auth.py), so an entry is found only where
-- it starts. Past 7,500 bytes the JSON could not be smaller: the list becomes the epoch and
-- E'\x1f\x1e', the overflow, and takes no more entries.

CREATE OR REPLACE FUNCTION aq_job_notice_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_old text := CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END;
    v_wake text := '0';
    v_list text;
BEGIN
    IF (v_old IN ('pending', 'running')
        AND (NEW.status NOT IN ('pending', 'running')
             OR (NEW.deleted_at IS NOT NULL AND OLD.deleted_at IS NULL)))
       OR (NEW.status = 'pending' AND v_old IS DISTINCT FROM 'pending') THEN
        v_wake := '1';
    END IF;
    v_list := current_setting('aq.changed', true);
    IF v_list IS NULL OR v_list = '' THEN
        v_list := extract(epoch FROM clock_timestamp())::text;
    ELSIF right(v_list, 1) = E'\x1e'
          OR strpos(v_list, E'\x1f1' || NEW.user_id || E'\x1f') > 0
          OR (v_wake = '0' AND strpos(v_list, E'\x1f0' || NEW.user_id || E'\x1f') > 0) THEN
        RETURN NULL;  -- the list says so already (or overflowed): nothing to write
    END IF;
    v_list := v_list || E'\x1f' || v_wake || NEW.user_id || E'\x1f';
    IF octet_length(v_list) > 7500 THEN
        v_list := split_part(v_list, E'\x1f', 1) || E'\x1f\x1e';
    END IF;
    PERFORM set_config('aq.changed', v_list, true);
    RETURN NULL;
END
$$;

-- At commit, once for each row of the first statement that changed jobs (see the triggers
-- below): the first firing writes the note (kept in aq.note with the length of the list it was
-- made from), every firing sends it.
CREATE OR REPLACE FUNCTION aq_job_notify_v3() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_list text := current_setting('aq.changed', true);
    v_made text;
    v_note text;
    v_at numeric;
BEGIN
    IF v_list IS NULL OR v_list = '' THEN
        RETURN NULL;
    END IF;
    v_made := current_setting('aq.note', true);
    IF split_part(v_made, ':', 1) = octet_length(v_list)::text THEN
        PERFORM pg_notify('aq_jobs_v2', substr(v_made, strpos(v_made, ':') + 1));
        RETURN NULL;
    END IF;
    v_at := split_part(v_list, E'\x1f', 1)::numeric;
    IF right(v_list, 1) <> E'\x1e' THEN
        SELECT jsonb_build_object('v', 2, 'at', v_at, 'u', jsonb_object_agg(u, w))::text
          INTO v_note
          FROM (SELECT substr(e, 2) AS u, max(left(e, 1))::integer AS w
                  FROM unnest(string_to_array(v_list, E'\x1f')) WITH ORDINALITY AS t(e, n)
                 WHERE n > 1 AND e <> ''
                 GROUP BY 1) s;
    END IF;
    IF v_note IS NULL OR octet_length(v_note) > 7500 THEN
        v_note := jsonb_build_object('v', 2, 'at', v_at, 'overflow', true)::text;
    END IF;
    PERFORM set_config('aq.note', octet_length(v_list) || ':' || v_note, true);
    PERFORM pg_notify('aq_jobs_v2', v_note);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER analysis_jobs_notice_insert_v1
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_notice_v1();

CREATE OR REPLACE TRIGGER analysis_jobs_notice_update_v1
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
          OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
    EXECUTE FUNCTION aq_job_notice_v1();

-- Constraint triggers have no OR REPLACE: made again whenever this file changes.
-- A constraint trigger's WHEN is evaluated as the row changes, not at commit, and the notice
-- triggers above write the list at the end of each statement: so only the rows of the
-- transaction's first changing statement (the list still empty) queue a firing for commit,
-- which then reads the whole list. (With SET CONSTRAINTS ... IMMEDIATE, which nothing here
-- sets, that firing would run at the end of the first statement and miss the later ones.)
DROP TRIGGER IF EXISTS analysis_jobs_notify_insert_v4 ON analysis_jobs;
CREATE CONSTRAINT TRIGGER analysis_jobs_notify_insert_v4
    AFTER INSERT ON analysis_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (coalesce(current_setting('aq.changed', true), '') = '')
    EXECUTE FUNCTION aq_job_notify_v3();

DROP TRIGGER IF EXISTS analysis_jobs_notify_update_v4 ON analysis_jobs;
CREATE CONSTRAINT TRIGGER analysis_jobs_notify_update_v4
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN ((OLD.status IS DISTINCT FROM NEW.status
           OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
           OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
          AND coalesce(current_setting('aq.changed', true), '') = '')
    EXECUTE FUNCTION aq_job_notify_v3();
