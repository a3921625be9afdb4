-- release: the dispatcher's writes: claims and running marks. (Retry schedules are a plain
-- compare-and-set statement in sql/queries.sql: job_release_retry.)

-- Core released these claimed runs: mark their jobs running, many in one transaction.
-- $1 job ids, $2 the instance that claimed them. Returns the jobs still pending and claimed by
-- $2, now running; a job that moved on meanwhile (a fast completion callback may already have
-- finished it) is left as it is and not returned.
--
-- A job's move to running writes an event, which locks its user's job_event_counters row until
-- commit, so the batch takes G shared and then its users' locks, sorted, like every decision
-- (docs/locking.md, "mark running"). Then one UPDATE moves all the jobs: PostgreSQL prepares a
-- table's CHECK constraints once per statement that writes it.
CREATE OR REPLACE FUNCTION aq_mark_running_v3(p_job_ids uuid[], p_instance text)
RETURNS TABLE (job_id uuid)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    PERFORM aq_lock_global_shared_v1();
    PERFORM aq_lock_users_v1(ARRAY(
        SELECT j.user_id FROM analysis_jobs j
         WHERE j.id = ANY (p_job_ids) AND j.status = 'pending' AND j.claimed_by = p_instance));
    -- A fresh statement: it sees what each user's last lock holder committed.
    RETURN QUERY
    UPDATE analysis_jobs j
       SET status = 'running', started_at = clock_timestamp(),
           updated_at = clock_timestamp(), claimed_by = NULL, claim_expires_at = NULL,
           next_release_at = NULL, error_code = NULL, error_detail = NULL
     WHERE j.id = ANY (p_job_ids) AND j.status = 'pending' AND j.claimed_by = p_instance
    RETURNING j.id;
END
$$;

-- Claim pending jobs for release, so that only one instance releases each: a compare-and-set
-- on status, lease and retry schedule. Returns the jobs claimed. SKIP LOCKED: a claim never
-- waits while holding other rows (two instances claim overlapping sets: both hear every
-- NOTIFY); a row someone holds is another instance's claim or a finish or cancel (it moves
-- on), and the rare holder that changes nothing leaves the job to the sweep's pending pass.
-- Rows this transaction holds itself are claimed (aq_claim_started_v1).
CREATE OR REPLACE FUNCTION aq_claim_v1(
    p_job_ids uuid[], p_instance text, p_lease_s double precision)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
    UPDATE analysis_jobs j
       SET claimed_by = p_instance,
           claim_expires_at = clock_timestamp() + make_interval(secs => p_lease_s),
           release_attempts = j.release_attempts + 1,
           updated_at = clock_timestamp()
      FROM (SELECT c.id FROM analysis_jobs c
             WHERE c.id = ANY (p_job_ids)
               AND c.status = 'pending'
               AND (c.claim_expires_at IS NULL OR c.claim_expires_at < clock_timestamp())
               AND (c.next_release_at IS NULL OR c.next_release_at <= clock_timestamp())
             ORDER BY c.id
               FOR UPDATE SKIP LOCKED) free
     WHERE j.id = free.id
    RETURNING j.*;
END
$$;

-- Claim, in the transaction that made them pending, the jobs a batch of admits or completions
-- started (aq_admit_v3, aq_finish_v3), for the instance that wrote the batch and will release
-- them at once: the claim is then no statement of its own between pending and running.
-- Returns the jobs as they are now, claimed or not, in the order given.
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
        SELECT c AS job FROM aq_claim_v1(ARRAY(SELECT x.id FROM unnest(p_jobs) x), p_instance,
                                         p_lease_s) c)
    SELECT array_agg(coalesce(c.job, p_jobs[s.n]) ORDER BY s.n) INTO v_out
      FROM generate_subscripts(p_jobs, 1) AS s(n)
      LEFT JOIN claimed c ON (c.job).id = (p_jobs[s.n]).id;
    RETURN v_out;
END
$$;
