-- 0003_job_notify_v1: wake every instance when a job is inserted or changes status.
--
-- Channel aq_jobs_v1. Payload (JSON, a few hundred bytes at most: user ids are <= 200 chars):
--   {"id": job id, "user_id": ..., "old": previous status or null on insert, "new": status,
--    "deleted": soft-deleted?, "delta": is a delta re-check?}
-- NOTIFY is a wake-up hint only; listeners re-read the job under the user lock.
-- Only status and deleted_at changes notify: bookkeeping updates (claims, attempts, polls) must
-- not flood the channel, and every notifying commit serializes on the cluster-wide NOTIFY lock.

CREATE FUNCTION aq_job_notify_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aq_jobs_v1', json_build_object(
        'id', NEW.id,
        'user_id', NEW.user_id,
        'old', CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END,
        'new', NEW.status,
        'deleted', NEW.deleted_at IS NOT NULL,
        'delta', NEW.delta_of_job_id IS NOT NULL)::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER analysis_jobs_notify_insert_v1
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_notify_v1();

CREATE TRIGGER analysis_jobs_notify_update_v1
    AFTER UPDATE OF status, deleted_at ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at)
    EXECUTE FUNCTION aq_job_notify_v1();
