-- release: the dispatcher's writes that need locks. (Claims and retry schedules are plain
-- compare-and-set statements in sql/queries.sql: jobs_claim, job_release_retry.)

-- Core released these claimed runs: mark their jobs running, many in one transaction.
-- $1 job ids, $2 the instance that claimed them. Returns the jobs moved; a job that moved on
-- meanwhile (a fast completion callback may already have finished it) is left as it is.
--
-- A job's move to running writes an event, which locks its user's job_event_counters row until
-- commit, so a batch over several users takes their locks first, as docs/locking.md says
-- ("mark running" and why).
CREATE OR REPLACE FUNCTION aq_mark_running_v1(p_job_ids uuid[], p_instance text)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_user text;
    v_id uuid;
    v_job analysis_jobs;
BEGIN
    PERFORM aq_lock_global_shared_v1();
    FOR v_user IN
        SELECT DISTINCT j.user_id FROM analysis_jobs j
         WHERE j.id = ANY (p_job_ids) AND j.status = 'pending' AND j.claimed_by = p_instance
         ORDER BY j.user_id
    LOOP
        PERFORM aq_lock_user_v1(v_user);
        -- Fresh statements from here: they see what the user's last lock holder committed.
        FOR v_id IN
            SELECT j.id FROM analysis_jobs j
             WHERE j.id = ANY (p_job_ids) AND j.user_id = v_user
             ORDER BY j.id
        LOOP
            UPDATE analysis_jobs j
               SET status = 'running', started_at = clock_timestamp(),
                   updated_at = clock_timestamp(),
                   claimed_by = NULL, claim_expires_at = NULL, next_release_at = NULL,
                   error_code = NULL, error_detail = NULL
             WHERE j.id = v_id AND j.status = 'pending' AND j.claimed_by = p_instance
            RETURNING j.* INTO v_job;
            IF FOUND THEN
                RETURN NEXT v_job;
            END IF;
        END LOOP;
    END LOOP;
END
$$;
