-- job_events: write a job_events row in the transaction of every job change.
--
-- Fires on exactly what job_notify.sql notifies, so every committed event comes with a NOTIFY
-- on aq_jobs_v1 that wakes the instances' event hubs (which read the events from the table).
-- Kinds (analysis_queue.models.EventKind): admitted (insert), deleted (deleted_at set; the job
-- keeps its final status), waiting (a queued job's wait changed), promoted (-> pending),
-- started (-> running), finished (-> succeeded | failed), cancelled (-> cancelled), changed
-- (any other move, e.g. a manual fix).
--
-- Ids are per user, dense and in commit order: the UPDATE of the user's counter row holds that
-- row's lock until commit, so the user's next event-writing transaction takes the next id only
-- after this one committed, and a rollback gives its id back. The counter row is the last lock
-- its writer takes (docs/locking.md).

CREATE OR REPLACE FUNCTION aq_job_event_v2() RETURNS trigger
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

CREATE OR REPLACE TRIGGER analysis_jobs_event_insert_v2
    AFTER INSERT ON analysis_jobs
    FOR EACH ROW EXECUTE FUNCTION aq_job_event_v2();

CREATE OR REPLACE TRIGGER analysis_jobs_event_update_v2
    AFTER UPDATE OF status, deleted_at, waiting_for ON analysis_jobs
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at
          OR (NEW.status = 'queued' AND OLD.waiting_for IS DISTINCT FROM NEW.waiting_for))
    EXECUTE FUNCTION aq_job_event_v2();
