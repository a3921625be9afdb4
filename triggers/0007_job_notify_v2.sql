-- 0007_job_notify_v2: the NOTIFY payload also says when the change was written, so listeners
-- can measure notification lag (aq_notification_lag_seconds).
--
-- Payload: v1's keys (id, user_id, old, new, deleted, delta) plus "at" (epoch seconds,
-- clock_timestamp() of the change). Listeners of v1 ignore the extra key, so old and new
-- instances overlap safely in a rolling deploy. aq_job_notify_v1 stays until no old code runs.

CREATE FUNCTION aq_job_notify_v2() RETURNS trigger
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

DROP TRIGGER analysis_jobs_notify_insert_v1 ON analysis_jobs;
DROP TRIGGER analysis_jobs_notify_update_v1 ON analysis_jobs;

CREATE TRIGGER analysis_jobs_notify_insert_v2
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_notify_v2();

CREATE TRIGGER analysis_jobs_notify_update_v2
    AFTER UPDATE OF status, deleted_at ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at)
    EXECUTE FUNCTION aq_job_notify_v2();
