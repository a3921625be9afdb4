-- promote: fill free slots, in admission order per user and in fair turns across users.
--
-- Who calls what (loops/promote.py decides when): a completion fills the slot it frees itself
-- (finish.sql); a promotion pass (aq_promote_v4) fills what is left, woken by a notification
-- (aq_promote_woken_v2), asked for by an admit, a cancel or a change of limit, or run by the
-- sweep. Locks: docs/locking.md. Every function here that starts a job writes it 'pending'
-- with promoted_at, claimed for p_instance when given (aq_claim_started_v1, release.sql); the
-- caller hands it to the dispatcher, which releases its held run.

-- Replaced by the versions below, which claim what they start.
DROP FUNCTION IF EXISTS aq_promote_woken_v1(text[], integer);
DROP FUNCTION IF EXISTS aq_promote_v3(text[], integer);

-- A promotion pass, in its own transaction: the decision's locks for p_users
-- (aq_lock_decision_v2: with the ceiling on, also the users next in turn for the free global
-- slots), then the one placement (aq_place_locked_v2), giving at most p_max global slots; what
-- it starts is claimed for p_instance (NULL: left unclaimed) for p_lease_s seconds.
-- Returns the ceiling in force and, one per row, the jobs it started (one row with job NULL
-- when none), so the caller learns the mode from every call.
CREATE OR REPLACE FUNCTION aq_promote_v4(
    p_users text[], p_max integer, p_instance text, p_lease_s double precision,
    OUT ceiling integer, OUT job analysis_jobs)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_lock record;
    v_place record;
BEGIN
    SELECT * INTO v_lock FROM aq_lock_decision_v2(p_users, true);
    ceiling := v_lock.ceiling;
    SELECT * INTO v_place FROM aq_place_locked_v2(
        v_lock.users, v_lock.ceiling, v_lock.allocates, p_max, NULL, '{}', '{}', '{}');
    FOREACH job IN ARRAY aq_claim_started_v1(v_place.promoted, p_instance, p_lease_s) LOOP
        RETURN NEXT;
    END LOOP;
    IF cardinality(v_place.promoted) = 0 THEN
        job := NULL;
        RETURN NEXT;
    END IF;
END
$$;


-- Whether a pass may start a job of p_user, as a wake-up reads it without a lock
-- (aq_promote_woken_v2): room (fewer active first-pass jobs than the limit) and a queued head
-- that does not wait for the provider (with the ceiling on, its wait is stale); or, ceiling
-- off, a delta still waiting for capacity.
CREATE OR REPLACE FUNCTION aq_fillable_v1(p_user text, p_ceiling integer) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_head text;
BEGIN
    SELECT q.waiting_for INTO v_head FROM analysis_jobs q
     WHERE q.user_id = p_user AND q.status = 'queued' AND aq_first_pass_v1(q.delta_of_job_id)
     ORDER BY q.queue_seq
     LIMIT 1;
    IF FOUND AND (p_ceiling IS NULL OR v_head = 'your_previous_analysis')
            AND (SELECT count(*) FROM analysis_jobs a
                  WHERE a.user_id = p_user AND a.status IN ('pending', 'running')
                    AND aq_first_pass_v1(a.delta_of_job_id)) < aq_user_limit_v1(p_user) THEN
        RETURN true;
    END IF;
    RETURN p_ceiling IS NULL AND EXISTS (
        SELECT 1 FROM analysis_jobs d
         WHERE d.user_id = p_user AND d.status = 'queued'
           AND d.waiting_for = 'provider_capacity'
           AND NOT aq_first_pass_v1(d.delta_of_job_id));
END
$$;

-- The pending jobs of p_user that nobody is releasing: unclaimed (or the claim's lease ran
-- out) and due. First-pass jobs through the user's slots, deltas through the open work: the
-- user's history is never read.
CREATE OR REPLACE FUNCTION aq_unreleased_v1(p_user text) RETURNS SETOF analysis_jobs
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
        SELECT j.* FROM analysis_jobs j
         WHERE j.user_id = p_user AND j.status IN ('pending', 'running')
           AND aq_first_pass_v1(j.delta_of_job_id) AND j.status = 'pending'
           AND (j.claim_expires_at IS NULL OR j.claim_expires_at < clock_timestamp())
           AND (j.next_release_at IS NULL OR j.next_release_at <= clock_timestamp())
        UNION ALL
        SELECT j.* FROM analysis_jobs j
         WHERE j.status = 'pending' AND NOT aq_first_pass_v1(j.delta_of_job_id)
           AND j.user_id = p_user
           AND (j.claim_expires_at IS NULL OR j.claim_expires_at < clock_timestamp())
           AND (j.next_release_at IS NULL OR j.next_release_at <= clock_timestamp());
END
$$;

-- A wake-up (a notification about p_users' jobs): fill what it left to fill, and name the
-- pending jobs of p_users nobody is releasing. Reads without a lock first, so the usual wake
-- (the change already filled its own slot, or freed none) costs a few index lookups and takes
-- no lock; only users with room and a queued head that should move, or with the ceiling on a
-- free global slot and a ready job, go on to aq_promote_v4, which claims what it starts for
-- p_instance. Returns the ceiling in force and one row per job: promoted by this call
-- (promoted = true) or pending, unclaimed and due (false); one row with job NULL when there is
-- none. Simple statements per user, each planned once per session: one query over the array
-- was planned anew on every call (about 1 ms).
CREATE OR REPLACE FUNCTION aq_promote_woken_v2(
    p_users text[], p_max integer, p_instance text, p_lease_s double precision,
    OUT ceiling integer, OUT job analysis_jobs, OUT promoted boolean)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_user text;
    v_users text[] := '{}';
    v_woken text[];
    v_ids uuid[] := '{}';
    v_row record;
    v_job analysis_jobs;
BEGIN
    ceiling := aq_ceiling_v2();
    SELECT coalesce(array_agg(DISTINCT u ORDER BY u), '{}') INTO v_woken
      FROM unnest(p_users) u WHERE u IS NOT NULL;
    FOREACH v_user IN ARRAY v_woken LOOP
        IF aq_fillable_v1(v_user, ceiling) THEN
            v_users := v_users || v_user;
        END IF;
    END LOOP;
    IF cardinality(v_users) > 0 OR (
            ceiling IS NOT NULL
            AND EXISTS (SELECT 1 FROM analysis_jobs r
                         WHERE r.status = 'queued' AND r.waiting_for = 'provider_capacity')
            AND (SELECT count(*) FROM analysis_jobs a
                  WHERE a.status IN ('pending', 'running')) < ceiling) THEN
        FOR v_row IN SELECT * FROM aq_promote_v4(v_users, p_max, p_instance, p_lease_s) LOOP
            ceiling := v_row.ceiling;
            CONTINUE WHEN (v_row.job).id IS NULL;
            job := v_row.job;
            promoted := true;
            v_ids := v_ids || job.id;
            RETURN NEXT;
        END LOOP;
    END IF;
    FOREACH v_user IN ARRAY v_woken LOOP
        FOR v_job IN SELECT * FROM aq_unreleased_v1(v_user) LOOP
            CONTINUE WHEN v_job.id = ANY (v_ids);
            job := v_job;
            promoted := false;
            v_ids := v_ids || job.id;
            RETURN NEXT;
        END LOOP;
    END LOOP;
    IF cardinality(v_ids) = 0 THEN
        job := NULL;
        promoted := NULL;
        RETURN NEXT;
    END IF;
END
$$;

-- Set the ceiling (NULL: off). Waits for every decision in flight under the old value. The
-- caller then runs promotion passes to fill what a raise (or turning it off) freed.
CREATE OR REPLACE FUNCTION aq_set_ceiling_v1(p_ceiling integer) RETURNS integer
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    PERFORM aq_lock_global_v1();
    UPDATE queue_settings
       SET global_max_running = p_ceiling, updated_at = clock_timestamp()
     WHERE global_max_running IS DISTINCT FROM p_ceiling;
    RETURN p_ceiling;
END
$$;

-- Set a user's concurrency (NULL: back to the default of 1) under the decision's locks, and
-- place the user's queue again (aq_place_locked_v2): a raise starts what it allows, a cut
-- leaves what runs running and queues the rest. Returns the jobs it started.
CREATE OR REPLACE FUNCTION aq_set_user_limit_v1(p_user_id text, p_max_running integer)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_lock record;
    v_place record;
BEGIN
    SELECT * INTO v_lock FROM aq_lock_decision_v2(ARRAY[p_user_id], true);
    IF p_max_running IS NULL THEN
        DELETE FROM user_limits WHERE user_id = p_user_id;
    ELSE
        INSERT INTO user_limits AS l (user_id, max_running) VALUES (p_user_id, p_max_running)
        ON CONFLICT (user_id) DO UPDATE
            SET max_running = EXCLUDED.max_running, updated_at = clock_timestamp();
    END IF;
    SELECT * INTO v_place FROM aq_place_locked_v2(
        v_lock.users, v_lock.ceiling, v_lock.allocates, NULL, NULL, '{}', '{}', '{}');
    RETURN QUERY SELECT * FROM unnest(v_place.promoted);
END
$$;
