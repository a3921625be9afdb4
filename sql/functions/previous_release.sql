-- previous_release: what only instances of the previous release (0.1) call.
--
-- During a rolling deploy the old instances keep calling the entry points their queries.sql
-- names, and their SQL keeps the signatures they were written against (docs/operations.md,
-- "Schema changes"). Each function here keeps such a signature and now does what its
-- replacement does. Drop them all in the first numbered migration released after every 0.1
-- instance is gone.

-- 0.1's admit (queries.sql "admit"). Replaced by aq_admit_v2, which also returns every job the
-- admit started; 0.1 instances learned those from their NOTIFY.
-- Can go: in the first release after 0.2, once no 0.1 instance runs.
CREATE OR REPLACE FUNCTION aq_admit_v1(
    p_job_id uuid, p_user_id text, p_run_id uuid, p_core_run_id text,
    p_thesis jsonb, p_sources jsonb, p_cost integer, p_delta_of uuid,
    p_idempotency_key text, p_request_hash text,
    OUT job analysis_jobs, OUT queue_position bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v record;
BEGIN
    SELECT * INTO v
      FROM aq_admit_v2(p_job_id, p_user_id, p_run_id, p_core_run_id, p_thesis, p_sources,
                       p_cost, p_delta_of, p_idempotency_key, p_request_hash);
    job := v.job;
    queue_position := v.queue_position;
END
$$;

-- 0.1's finish (queries.sql "finish"). Replaced by aq_finish_v2, which also says whether it
-- refunded and returns every job it promoted, not only the first.
-- Can go: in the first release after 0.2, once no 0.1 instance runs.
CREATE OR REPLACE FUNCTION aq_finish_v1(
    p_job_id uuid, p_core_run_id text, p_user_id text,
    p_status text, p_from text[], p_delete boolean,
    p_error_code text, p_error_detail text, p_verdicts jsonb, p_ran boolean,
    OUT job analysis_jobs, OUT old_status text, OUT changed boolean,
    OUT promoted analysis_jobs)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v record;
BEGIN
    SELECT * INTO v
      FROM aq_finish_v2(p_job_id, p_core_run_id, p_user_id, p_status, p_from, p_delete,
                        p_error_code, p_error_detail, p_verdicts, p_ran);
    job := v.job;
    old_status := v.old_status;
    changed := v.changed;
    promoted := v.promoted[1];
END
$$;

-- The release before the ceiling called these when a user's slot freed; they follow the
-- ceiling's rules (a pass when it is on).
-- Can go: in the first release after 0.2, once no 0.1 instance runs.
CREATE OR REPLACE FUNCTION aq_promote_locked_v1(p_user_id text) RETURNS analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_job analysis_jobs;
BEGIN
    SELECT * INTO v_job FROM aq_fill_user_locked_v1(p_user_id) LIMIT 1;
    RETURN v_job;
END
$$;

CREATE OR REPLACE FUNCTION aq_promote_next_v1(p_user_id text) RETURNS analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_job analysis_jobs;
BEGIN
    SELECT (p.job).* INTO v_job FROM aq_promote_v2(ARRAY[p_user_id], 64) p
     WHERE (p.job).id IS NOT NULL LIMIT 1;
    RETURN v_job;
END
$$;

-- 0.1's ceiling helpers, called only by 0.1's function bodies (which the deploy replaces
-- before any instance calls them again). aq_ceiling_v1 read the ceiling *and*, when off, took
-- the global lock shared; every decision now does the two itself (docs/locking.md), reading
-- with aq_ceiling_v2.
-- Can go: in the first release after 0.2, once no 0.1 instance runs (nothing of 0.2 calls
-- them; 0.1's bodies are replaced by 0.2's before any 0.1 instance restarts).
CREATE OR REPLACE FUNCTION aq_ceiling_v1() RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ceiling integer := aq_ceiling_v2();
BEGIN
    IF v_ceiling IS NULL THEN
        PERFORM aq_lock_global_shared_v1();
        v_ceiling := aq_ceiling_v2();
    END IF;
    RETURN v_ceiling;
END
$$;

CREATE OR REPLACE FUNCTION aq_ceiling_held_v1() RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT s.global_max_running FROM queue_settings s
$$;

-- 0.1's running marks (queries.sql "jobs_mark_running"). Replaced by aq_mark_running_v2, which
-- can leave users whose locks are held elsewhere to a second, waiting call, and returns ids.
-- Can go: in the first release after 0.2, once no 0.1 instance runs.
CREATE OR REPLACE FUNCTION aq_mark_running_v1(p_job_ids uuid[], p_instance text)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_moved uuid[];
BEGIN
    SELECT coalesce(array_agg(m.job_id), '{}') INTO v_moved
      FROM aq_mark_running_v2(p_job_ids, p_instance, true) m
     WHERE m.moved;
    RETURN QUERY SELECT j.* FROM analysis_jobs j WHERE j.id = ANY (v_moved);
END
$$;
