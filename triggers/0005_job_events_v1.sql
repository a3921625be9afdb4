-- 0005_job_events_v1: write a job_events row in the transaction of every job change.
--
-- Fires on exactly what aq_job_notify_v1 notifies (insert; a change of status or deleted_at),
-- so every committed event comes with a NOTIFY on aq_jobs_v1 that wakes the instances' event
-- hubs; the NOTIFY payload is unchanged (the hub reads the events from this table).
-- Kinds: admitted (insert), deleted (deleted_at set; the job keeps its final status),
-- promoted (-> pending), started (-> running), finished (-> succeeded | failed),
-- cancelled (-> cancelled), changed (any other move, e.g. a manual fix).
--
-- Lock order: a writer holds the user's advisory lock (most writers) and the job's row lock
-- before this trigger locks the user's counter row; nothing takes them the other way round.

CREATE FUNCTION aq_job_event_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_kind text;
    v_id bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        v_kind := 'admitted';
    ELSIF NEW.deleted_at IS NOT NULL AND OLD.deleted_at IS NULL THEN
        v_kind := 'deleted';
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

CREATE TRIGGER analysis_jobs_event_insert_v1
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_event_v1();

CREATE TRIGGER analysis_jobs_event_update_v1
    AFTER UPDATE OF status, deleted_at ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at)
    EXECUTE FUNCTION aq_job_event_v1();
