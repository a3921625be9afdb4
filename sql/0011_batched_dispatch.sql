-- 0011_batched_dispatch: mark many released jobs running in one transaction, without deadlocks.
--
-- A job's move to running writes an event, which locks its user's job_event_counters row until
-- commit. One transaction for the jobs of several users therefore holds several users' counter
-- rows, and must take them in the order everyone else does (lock order, sql/0008): under the
-- global lock held shared (a pass with the ceiling on holds it exclusively and locks users in
-- turn order, so the two never interleave), then user by user in sorted order (as a pass with
-- the ceiling off does). Without this a batch and a promotion pass deadlocked on two users'
-- counters (tests/acceptance/test_ceiling_stress.py saw it).
--
-- $1 job ids, $2 the instance that claimed them. Returns the jobs moved; a job that moved on
-- meanwhile (a fast completion callback may already have finished it) is left as it is.

CREATE FUNCTION aq_mark_running_v1(p_job_ids uuid[], p_instance text)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id uuid;
    v_job analysis_jobs;
BEGIN
    PERFORM aq_lock_global_shared_v1();
    FOR v_id IN
        SELECT j.id FROM analysis_jobs j
         WHERE j.id = ANY (p_job_ids) AND j.status = 'pending' AND j.claimed_by = p_instance
         ORDER BY j.user_id, j.id
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
END
$$;
