-- job_notify: wake every instance, once per transaction, when jobs are inserted or change
-- status, deletion or wait.
--
-- Every notifying commit takes PostgreSQL's cluster-wide NOTIFY lock, so a transaction that
-- changes many jobs (a batch of admits, of completions, of running marks) sends one notification
-- for all of them: each change adds its user to a transaction-local note (the setting
-- aq.notice, set_config(..., true)), and a deferred trigger sends the note at commit. Every
-- deferred firing of the transaction sends the same text, which PostgreSQL folds into one
-- notification.
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

CREATE OR REPLACE FUNCTION aq_job_notice_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_note jsonb;
    v_old text := CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END;
    v_wake integer := 0;
    v_seen integer;
BEGIN
    IF (v_old IN ('pending', 'running')
        AND (NEW.status NOT IN ('pending', 'running')
             OR (NEW.deleted_at IS NOT NULL AND OLD.deleted_at IS NULL)))
       OR (NEW.status = 'pending' AND v_old IS DISTINCT FROM 'pending') THEN
        v_wake := 1;
    END IF;
    v_note := nullif(current_setting('aq.notice', true), '')::jsonb;
    IF v_note IS NULL THEN
        v_note := jsonb_build_object(
            'v', 2, 'at', extract(epoch FROM clock_timestamp()), 'u', '{}'::jsonb);
    ELSIF v_note ? 'overflow' THEN
        RETURN NULL;
    END IF;
    v_seen := (v_note -> 'u' ->> NEW.user_id)::integer;
    IF v_seen IS NOT NULL AND v_seen >= v_wake THEN
        RETURN NULL;  -- the note says so already: nothing to write
    END IF;
    v_note := jsonb_set(v_note, ARRAY['u', NEW.user_id], to_jsonb(v_wake));
    IF octet_length(v_note::text) > 7500 THEN
        v_note := jsonb_build_object('v', 2, 'at', v_note -> 'at', 'overflow', true);
    END IF;
    PERFORM set_config('aq.notice', v_note::text, true);
    RETURN NULL;
END
$$;

-- At commit, once per changed row, the same text: one notification.
CREATE OR REPLACE FUNCTION aq_job_notify_v3() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_note text := nullif(current_setting('aq.notice', true), '');
BEGIN
    IF v_note IS NOT NULL THEN
        PERFORM pg_notify('aq_jobs_v2', v_note);
    END IF;
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
DROP TRIGGER IF EXISTS analysis_jobs_notify_insert_v4 ON analysis_jobs;
CREATE CONSTRAINT TRIGGER analysis_jobs_notify_insert_v4
    AFTER INSERT ON analysis_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION aq_job_notify_v3();

DROP TRIGGER IF EXISTS analysis_jobs_notify_update_v4 ON analysis_jobs;
CREATE CONSTRAINT TRIGGER analysis_jobs_notify_update_v4
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
          OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
    EXECUTE FUNCTION aq_job_notify_v3();
