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
--   {"v": 2, "at": epoch seconds of the transaction's first change (the end of its statement),
--    "u": {user id: 1 if a change of theirs may leave work (a job left pending/running, or
--          became pending), else 0, ...}}
-- or, when the users would not fit, {"v": 2, "at": ..., "overflow": true}: listeners then
-- re-read everything (the catch-up they do after a reconnect).
-- NOTIFY is a wake-up hint only: listeners read the jobs and events of the users it names.
-- Only status, deleted_at and a queued job's wait notify: bookkeeping updates (claims,
-- attempts, polls) must not flood the channel. Fires on exactly what job_events.sql logs, so
-- every committed event comes with a wake-up.
--
-- The list (its format: job_events.sql) is the setting aq.changed, which the statement trigger
-- in job_events.sql extends, transaction-local, with the users of every change.

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

-- Constraint triggers have no OR REPLACE: made again whenever this file changes.
-- A constraint trigger's WHEN is evaluated as the row changes, not at commit, and the statement
-- trigger of job_events.sql writes the list at the end of each statement: so only the rows of the
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
