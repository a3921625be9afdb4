-- job_notify: wake every instance when a job is inserted or changes status, deletion or wait.
--
-- Channel aq_jobs_v1. Payload (JSON, a few hundred bytes at most: user ids are <= 200 chars;
-- analysis_queue.models.JobNotice reads it):
--   {"id": job id, "user_id": ..., "old": previous status or null on insert, "new": status,
--    "deleted": soft-deleted?, "delta": is a delta re-check?, "at": epoch seconds of the change}
-- NOTIFY is a wake-up hint only: listeners re-read the database. Only status, deleted_at and a
-- queued job's wait notify: bookkeeping updates (claims, attempts, polls) must not flood the
-- channel, and every notifying commit serializes on the cluster-wide NOTIFY lock. Fires on
-- exactly what job_events.sql logs, so every committed event comes with a wake-up.

CREATE OR REPLACE FUNCTION aq_job_notify_v2() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aq_jobs_v1', json_build_object(
        'id', NEW.id,
        'user_id', NEW.user_id,
        'old', CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END,
        'new', NEW.status,
        'deleted', NEW.deleted_at IS NOT NULL,
        'delta', NEW.delta_of_job_id IS NOT NULL,
        'at', extract(epoch FROM clock_timestamp()))::text);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER analysis_jobs_notify_insert_v2
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_notify_v2();

CREATE OR REPLACE TRIGGER analysis_jobs_notify_update_v3
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
          OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
    EXECUTE FUNCTION aq_job_notify_v2();
