-- 0011_batched_dispatch: mark many released jobs running in one transaction, without deadlocks.
--
-- A job's move to running writes an event, which locks its user's job_event_counters row until
-- commit. One transaction for the jobs of several users therefore holds several users' counter
-- rows and job rows, and must take them the way every other multi-user transaction does (lock
-- order, sql/0008): the global lock held shared (a pass with the ceiling on holds it exclusively
-- and locks users in turn order, so the two never interleave), then each user's lock, users in
-- sorted order (as a pass with the ceiling off does), and only then that user's rows. The user
-- lock matters too: a finish of another of the user's jobs (a limit above 1, a delta) holds the
-- user lock and that job's row, then takes the user's counter; without the lock a batch could
-- hold the counter and wait for the row. Both orders deadlocked in tests before this function
-- took them (a promotion pass: tests/acceptance/test_ceiling_stress.py; a finish: a review's
-- reproduction).
--
-- $1 job ids, $2 the instance that claimed them. Returns the jobs moved; a job that moved on
-- meanwhile (a fast completion callback may already have finished it) is left as it is.

CREATE FUNCTION aq_mark_running_v1(p_job_ids uuid[], p_instance text)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
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
