-- warm: walk a pooled connection through one job's whole path once, so that no user's first
-- admit, completion or promotion on that connection pays for compiling the PL/pgSQL functions
-- and planning their statements (a backend does both on first use; measured as the slowest
-- promotions of a run: docs/benchmarks.md).
--
-- store/database.py calls it when it opens a connection, inside a transaction it rolls back:
-- nothing of it stays (sequence values aside), no notification goes out, and its user's lock is
-- held for the few milliseconds it takes. The user is the backend's own, so connections that
-- open together (a pool growing under load) do not queue on one user's lock and credit row.
-- With the ceiling on it takes G exclusively first: its steps are several decisions in one
-- transaction, which take G shared and then exclusively (an admit or a wake-up that gives out
-- a slot), and two warm-ups each holding G shared while waiting for it exclusively deadlock
-- (docs/locking.md: no decision upgrades its hold on G). Should the ceiling be turned on
-- between that check and the steps, such a deadlock fails one warm-up, which the pool skips.
-- The user id cannot be a real one's: a JWT subject has no control characters (http/auth.py).

CREATE OR REPLACE FUNCTION aq_warm_up_v1() RETURNS integer
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_user text := E'\x01warm-up/' || pg_backend_pid();
    v_runs uuid[] := ARRAY[gen_random_uuid(), gen_random_uuid()];
    v_jobs uuid[] := ARRAY[gen_random_uuid(), gen_random_uuid()];
    v_items jsonb := '[]';
    v_steps integer := 0;
    v_job analysis_jobs;
BEGIN
    IF aq_ceiling_v2() IS NOT NULL THEN
        PERFORM aq_lock_global_v1();
    END IF;
    PERFORM aq_credit_grant_v1(v_user, 2, NULL);
    FOR n IN 1..2 LOOP
        v_items := v_items || jsonb_build_object(
            'item', n - 1, 'user_id', v_user, 'run_id', v_runs[n], 'job_id', v_jobs[n],
            'cost', 1, 'thesis', '{}'::jsonb, 'sources', '[]'::jsonb,
            'idempotency_key', NULL, 'request_hash', NULL);
    END LOOP;
    PERFORM aq_reserve_v2(v_items);
    v_items := (SELECT jsonb_agg(i || jsonb_build_object(
                    'core_run_id', 'warm-' || (i ->> 'job_id'), 'delta_of', NULL))
                  FROM jsonb_array_elements(v_items) i);
    PERFORM aq_admit_v3(v_items, 'warm-up', 1);
    -- The first job runs, then Core reports it done: its finish promotes the second.
    PERFORM aq_mark_running_v3(ARRAY[v_jobs[1]], 'warm-up');
    PERFORM aq_finish_v3(
        jsonb_build_array(jsonb_build_object(
            'item', 0, 'core_run_id', 'warm-' || v_jobs[1], 'status', 'succeeded',
            'from', ARRAY['pending', 'running'], 'error_code', NULL, 'error_detail', NULL,
            'verdicts', '[]'::jsonb, 'ran', true)),
        'warm-up', 1);
    PERFORM aq_promote_woken_v2(ARRAY[v_user], 1, NULL, NULL);
    -- Through the index a user's list reads (analysis_jobs_user_pages, deleted_at IS NULL):
    -- without that predicate this read scanned the whole table, seconds for every new
    -- connection once the table holds a year of history (bench/run.py --only history).
    FOR v_job IN SELECT * FROM analysis_jobs j
                  WHERE j.user_id = v_user AND j.deleted_at IS NULL LOOP
        v_steps := v_steps + 1;
    END LOOP;
    RETURN v_steps;
END
$$;
