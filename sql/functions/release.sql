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

-- Claim, in the transaction that made them pending, the jobs a batch of admits or completions
-- started (aq_admit_many_v1, aq_finish_many_v1), for the instance that wrote the batch and will
-- release them at once: the claim is then no statement of its own between pending and running.
-- The same compare-and-set as the claim query (jobs_claim). Returns the jobs as they are now,
-- claimed or not, in the order given.
CREATE OR REPLACE FUNCTION aq_claim_started_v1(
    p_jobs analysis_jobs[], p_instance text, p_lease_s double precision)
RETURNS analysis_jobs[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claimed analysis_jobs[];
    v_job analysis_jobs;
    v_now analysis_jobs;
    v_out analysis_jobs[] := '{}';
BEGIN
    IF p_instance IS NULL OR coalesce(cardinality(p_jobs), 0) = 0 THEN
        RETURN coalesce(p_jobs, '{}');
    END IF;
    WITH claimed AS (
        UPDATE analysis_jobs j
           SET claimed_by = p_instance,
               claim_expires_at = clock_timestamp() + make_interval(secs => p_lease_s),
               release_attempts = j.release_attempts + 1,
               updated_at = clock_timestamp()
         WHERE j.id = ANY (ARRAY(SELECT x.id FROM unnest(p_jobs) x))
           AND j.status = 'pending'
           AND (j.claim_expires_at IS NULL OR j.claim_expires_at < clock_timestamp())
           AND (j.next_release_at IS NULL OR j.next_release_at <= clock_timestamp())
        RETURNING j.*)
    SELECT coalesce(array_agg(c), '{}') INTO v_claimed FROM claimed c;
    FOREACH v_job IN ARRAY p_jobs LOOP
        SELECT c.* INTO v_now FROM unnest(v_claimed) c WHERE c.id = v_job.id;
        v_out := v_out || CASE WHEN FOUND THEN v_now ELSE v_job END;
    END LOOP;
    RETURN v_out;
END
$$;
