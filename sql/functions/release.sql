-- release: the dispatcher's writes that need locks. (Claims and retry schedules are plain
-- compare-and-set statements in sql/queries.sql: jobs_claim, job_release_retry.)

-- Core released these claimed runs: mark their jobs running, many in one transaction.
-- $1 job ids, $2 the instance that claimed them, $3 whether to wait for a user's lock held
-- elsewhere. Returns, for each job still pending and claimed by $2, whether it moved to running;
-- a job that moved on meanwhile (a fast completion callback may already have finished it) is
-- left as it is and not returned.
--
-- A job's move to running writes an event, which locks its user's job_event_counters row until
-- commit, so a batch over several users takes their locks first, sorted, as docs/locking.md
-- says ("mark running" and why). Without p_wait it only tries them: a user whose lock is held
-- elsewhere (most often by the finish of that very job) is left out, and the batch neither
-- waits nor holds the locks it has while another transaction finishes; its caller asks again,
-- waiting, for those jobs alone (queue/dispatch.py). Then one UPDATE moves all the jobs whose
-- users it holds: PostgreSQL prepares a table's CHECK constraints once per statement that
-- writes it, so a statement per job paid for that once per job.
CREATE OR REPLACE FUNCTION aq_mark_running_v2(
    p_job_ids uuid[], p_instance text, p_wait boolean)
RETURNS TABLE (job_id uuid, moved boolean)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_user text;
    v_users text[] := '{}';
    v_busy text[] := '{}';
BEGIN
    PERFORM aq_lock_global_shared_v1();
    FOR v_user IN
        SELECT DISTINCT j.user_id FROM analysis_jobs j
         WHERE j.id = ANY (p_job_ids) AND j.status = 'pending' AND j.claimed_by = p_instance
         ORDER BY j.user_id
    LOOP
        IF p_wait THEN
            PERFORM aq_lock_user_v1(v_user);
        ELSIF NOT aq_try_lock_user_v1(v_user) THEN
            v_busy := v_busy || v_user;
            CONTINUE;
        END IF;
        v_users := v_users || v_user;
    END LOOP;
    IF cardinality(v_users) > 0 THEN
        -- A fresh statement: it sees what each user's last lock holder committed. Only the
        -- users whose locks are held: a job is never moved without its user's lock.
        RETURN QUERY
        UPDATE analysis_jobs j
           SET status = 'running', started_at = clock_timestamp(),
               updated_at = clock_timestamp(), claimed_by = NULL, claim_expires_at = NULL,
               next_release_at = NULL, error_code = NULL, error_detail = NULL
         WHERE j.id = ANY (p_job_ids) AND j.user_id = ANY (v_users)
           AND j.status = 'pending' AND j.claimed_by = p_instance
        RETURNING j.id, true;
    END IF;
    IF cardinality(v_busy) > 0 THEN
        RETURN QUERY
        SELECT j.id, false FROM analysis_jobs j
         WHERE j.id = ANY (p_job_ids) AND j.user_id = ANY (v_busy)
           AND j.status = 'pending' AND j.claimed_by = p_instance;
    END IF;
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
    v_out analysis_jobs[];
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
        RETURNING j AS job)
    SELECT array_agg(coalesce(c.job, p_jobs[s.n]) ORDER BY s.n) INTO v_out
      FROM generate_subscripts(p_jobs, 1) AS s(n)
      LEFT JOIN claimed c ON (c.job).id = (p_jobs[s.n]).id;
    RETURN v_out;
END
$$;
