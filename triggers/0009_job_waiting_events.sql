-- 0009_job_waiting_events: a queued job's change of wait (waiting_for) is an event and a
-- wake-up, like a change of status.
--
-- The event kind is 'waiting'; the NOTIFY payload is v2's with old = new = 'queued', which
-- listeners of every version treat as "nothing frees, nothing to release" and the event hubs
-- as "read this user's events".

ALTER TABLE job_events DROP CONSTRAINT job_events_kind_check;
ALTER TABLE job_events ADD CONSTRAINT job_events_kind_check CHECK (kind IN
    ('admitted', 'promoted', 'started', 'finished', 'cancelled', 'deleted', 'changed',
     'waiting'));

-- As aq_job_event_v1, plus 'waiting' for a queued job whose wait changed.
CREATE FUNCTION aq_job_event_v2() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_kind text;
    v_id bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        v_kind := 'admitted';
    ELSIF NEW.deleted_at IS NOT NULL AND OLD.deleted_at IS NULL THEN
        v_kind := 'deleted';
    ELSIF NEW.status = OLD.status AND NEW.status = 'queued' THEN
        v_kind := 'waiting';
    ELSE
        v_kind := CASE NEW.status
            WHEN 'pending' THEN 'promoted'
            WHEN 'running' THEN 'started'
            WHEN 'succeeded' THEN 'finished'
            WHEN 'failed' THEN 'finished'
            WHEN 'cancelled' THEN 'cancelled'
            ELSE 'changed' END;
    END IF;

    -- The row lock taken here is held until commit: the user's next event-writing transaction
    -- waits for it, so ids follow commit order.
    UPDATE job_event_counters SET last_id = last_id + 1
     WHERE user_id = NEW.user_id
    RETURNING last_id INTO v_id;
    IF NOT FOUND THEN
        INSERT INTO job_event_counters AS c (user_id, last_id) VALUES (NEW.user_id, 1)
        ON CONFLICT (user_id) DO UPDATE SET last_id = c.last_id + 1
        RETURNING c.last_id INTO v_id;
    END IF;

    INSERT INTO job_events (user_id, event_id, job_id, kind, created_at)
    VALUES (NEW.user_id, v_id, NEW.id, v_kind, clock_timestamp());
    RETURN NULL;
END
$$;

DROP TRIGGER analysis_jobs_event_insert_v1 ON analysis_jobs;
DROP TRIGGER analysis_jobs_event_update_v1 ON analysis_jobs;
DROP TRIGGER analysis_jobs_notify_update_v2 ON analysis_jobs;

CREATE TRIGGER analysis_jobs_event_insert_v2
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_event_v2();

CREATE TRIGGER analysis_jobs_event_update_v2
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
          OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
    EXECUTE FUNCTION aq_job_event_v2();

CREATE TRIGGER analysis_jobs_notify_update_v3
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
          OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
    EXECUTE FUNCTION aq_job_notify_v2();
