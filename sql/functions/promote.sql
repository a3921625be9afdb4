-- promote: fill free slots, in admission order per user and in fair turns across users.
--
-- Who calls what (queue/promote.py decides when): a completion fills the slot it frees itself
-- (finish.sql); a promotion pass (aq_promote_v2) fills what is left, woken by a notification
-- (aq_promote_woken_v1), asked for by an admit, a cancel or a change of limit, or run by the
-- sweep. Locks: docs/locking.md. Every function here that starts a job writes it 'pending'
-- with promoted_at; the caller hands it to the dispatcher, which releases its held run.

-- Users' locks held, ceiling off. Start the users' waiting deltas, then fill each user's free
-- slots from the head of their queue, in order: the k-th job of a queue takes the k-th free slot
-- (aq_free_slots_v1). One statement for all the users, so that a batch of completions fills
-- every slot it freed at once (finish.sql). Returns the jobs promoted, by user, in queue order.
CREATE OR REPLACE FUNCTION aq_fill_users_locked_v1(p_users text[]) RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- What waited for capacity under a ceiling that was just turned off: deltas start at once,
    -- first-pass jobs wait for their user again (the fill below starts those with room). One
    -- statement, when there is any such job: usually there is none, and a probe of the index
    -- is cheaper than an UPDATE on no row (which opens every index of the table).
    IF EXISTS (SELECT 1 FROM analysis_jobs j
                WHERE j.user_id = ANY (p_users) AND j.status = 'queued'
                  AND j.waiting_for = 'provider_capacity') THEN
        RETURN QUERY
        WITH moved AS (
            UPDATE analysis_jobs j
               SET status = CASE WHEN j.delta_of_job_id IS NULL THEN 'queued' ELSE 'pending' END,
                   waiting_for = CASE WHEN j.delta_of_job_id IS NULL
                                      THEN 'your_previous_analysis' END,
                   turn_key = NULL,
                   promoted_at = CASE WHEN j.delta_of_job_id IS NULL THEN NULL
                                      ELSE clock_timestamp() END,
                   updated_at = clock_timestamp()
             WHERE j.user_id = ANY (p_users) AND j.status = 'queued'
               AND j.waiting_for = 'provider_capacity'
            RETURNING j.*)
        SELECT * FROM moved m WHERE m.status = 'pending' ORDER BY m.user_id, m.queue_seq;
    END IF;
    -- status = 'queued' is repeated outside the heads: after a row-lock wait READ COMMITTED
    -- re-checks only the UPDATE's own WHERE; a job cancelled meanwhile stays cancelled.
    RETURN QUERY
    WITH room AS (
        SELECT u.user_id, aq_free_slots_v1(s.max_running, s.used) AS slots
          FROM (SELECT DISTINCT x.u AS user_id FROM unnest(p_users) AS x(u)
                 WHERE x.u IS NOT NULL) u
          CROSS JOIN LATERAL aq_user_slots_v1(u.user_id) s),
    heads AS (
        SELECT h.id, r.slots[h.k] AS slot
          FROM room r
          CROSS JOIN LATERAL (
                SELECT q.id, row_number() OVER (ORDER BY q.queue_seq) AS k
                  FROM analysis_jobs q
                 WHERE q.user_id = r.user_id AND q.status = 'queued'
                   AND q.delta_of_job_id IS NULL
                 ORDER BY q.queue_seq
                 LIMIT cardinality(r.slots)) h),
    moved AS (
        UPDATE analysis_jobs j
           SET status = 'pending', user_slot = h.slot, waiting_for = NULL, turn_key = NULL,
               promoted_at = clock_timestamp(), updated_at = clock_timestamp()
          FROM heads h
         WHERE j.id = h.id AND j.status = 'queued'
        RETURNING j.*)
    SELECT * FROM moved m ORDER BY m.user_id, m.queue_seq;
END
$$;

-- One user's fill (aq_fill_users_locked_v1), for the callers that decide for one user.
CREATE OR REPLACE FUNCTION aq_fill_user_locked_v1(p_user_id text) RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT * FROM aq_fill_users_locked_v1(ARRAY[p_user_id]);
END
$$;

-- The user's lock held, ceiling on, and either the global lock held (exclusively or by a
-- successful try) or p_slot given: the global slot this transaction just freed, which nobody
-- else can see free before it commits, so taking it again needs no allocation and no lock.
-- Start one ready job of p_user_id: p_job_id when it is a delta, else the user's oldest queued
-- first-pass job. NULL when it cannot start (no global slot, no user slot, nothing ready).
CREATE OR REPLACE FUNCTION aq_start_locked_v1(
    p_user_id text, p_job_id uuid, p_ceiling integer, p_slot integer DEFAULT NULL)
RETURNS analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_job analysis_jobs;
    v_full boolean;
    v_used integer[];
    v_global integer;
    v_user integer;
    v_delta boolean;
BEGIN
    -- Under the global lock the slots in use can only free meanwhile, never fill. Reusing a
    -- slot just freed keeps the count; the check only honours a ceiling lowered meanwhile.
    SELECT count(*) >= p_ceiling,
           coalesce(array_agg(a.global_slot) FILTER (WHERE a.global_slot IS NOT NULL), '{}')
      INTO v_full, v_used
      FROM analysis_jobs a WHERE a.status IN ('pending', 'running');
    IF v_full THEN
        RETURN NULL;
    END IF;
    v_global := coalesce(p_slot, (SELECT s FROM generate_series(1, p_ceiling) s
                                   WHERE s <> ALL (v_used) ORDER BY s LIMIT 1));
    IF v_global IS NULL OR v_global > p_ceiling THEN
        RETURN NULL;
    END IF;

    SELECT j.delta_of_job_id IS NOT NULL INTO v_delta FROM analysis_jobs j
     WHERE j.id = p_job_id AND j.status = 'queued' AND j.waiting_for = 'provider_capacity';
    IF NOT FOUND THEN
        PERFORM aq_refresh_waits_locked_v1(p_user_id, p_ceiling);
        RETURN NULL;
    END IF;
    IF v_delta THEN
        UPDATE analysis_jobs j
           SET status = 'pending', global_slot = v_global, waiting_for = NULL, turn_key = NULL,
               promoted_at = clock_timestamp(), updated_at = clock_timestamp()
         WHERE j.id = p_job_id AND j.status = 'queued'
        RETURNING j.* INTO v_job;
        RETURN v_job;
    END IF;

    v_user := aq_free_user_slot_v1(p_user_id);
    IF v_user IS NULL THEN
        PERFORM aq_refresh_waits_locked_v1(p_user_id, p_ceiling);
        RETURN NULL;
    END IF;
    UPDATE analysis_jobs j
       SET status = 'pending', user_slot = v_user, global_slot = v_global,
           waiting_for = NULL, turn_key = NULL,
           promoted_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE j.id = (
            SELECT q.id FROM analysis_jobs q
             WHERE q.user_id = p_user_id AND q.status = 'queued' AND q.delta_of_job_id IS NULL
             ORDER BY q.queue_seq
             LIMIT 1)
       AND j.status = 'queued'
    RETURNING j.* INTO v_job;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO user_turns AS t (user_id, last_turn_at)
    VALUES (p_user_id, v_job.promoted_at)
    ON CONFLICT (user_id) DO UPDATE SET last_turn_at = EXCLUDED.last_turn_at;
    -- The user's other ready jobs go behind everyone waiting now.
    PERFORM aq_refresh_waits_locked_v1(p_user_id, p_ceiling);
    RETURN v_job;
END
$$;

-- p_user_id's lock held, ceiling on, and the global lock held by a successful try or p_slot
-- just freed (see aq_start_locked_v1): start the fairest ready job if it is p_user_id's
-- (admission and completion, which must not wait for other users' locks). NULL otherwise: a
-- promotion pass gives the slot to whoever it belongs to.
CREATE OR REPLACE FUNCTION aq_start_own_if_fairest_v1(
    p_user_id text, p_ceiling integer, p_slot integer DEFAULT NULL)
RETURNS analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_pick record;
BEGIN
    SELECT q.id, q.user_id INTO v_pick FROM analysis_jobs q
     WHERE q.status = 'queued' AND q.waiting_for = 'provider_capacity'
     ORDER BY q.turn_key, q.queue_seq
     LIMIT 1;
    IF NOT FOUND OR v_pick.user_id <> p_user_id THEN
        RETURN NULL;
    END IF;
    RETURN aq_start_locked_v1(p_user_id, v_pick.id, p_ceiling, p_slot);
END
$$;

-- A promotion pass, in its own transaction, holding no lock: fill free slots.
--   ceiling on:  take the global lock; re-derive the waits of p_users (users whose slot freed:
--                their completion may have been written by something that did not); then give
--                each free global slot to the fairest ready job, at most p_max, locking each
--                chosen user in turn.
--   ceiling off: fill the free slots of each of p_users from its queue.
-- Users are locked in sorted order. Returns the ceiling in force and, one per row, the jobs
-- promoted (one row with job NULL when none), so the caller learns the mode from every call.
CREATE OR REPLACE FUNCTION aq_promote_v2(
    p_users text[], p_max integer, OUT ceiling integer, OUT job analysis_jobs)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_user text;
    v_users text[];
    v_pick record;
    v_job analysis_jobs;
    v_skipped uuid[] := '{}';
    v_n integer := 0;
BEGIN
    SELECT coalesce(array_agg(DISTINCT u ORDER BY u), '{}') INTO v_users
      FROM unnest(p_users) u WHERE u IS NOT NULL;
    ceiling := aq_ceiling_v2();
    IF ceiling IS NULL THEN
        PERFORM aq_lock_global_shared_v1();
        ceiling := aq_ceiling_v2();
        IF ceiling IS NOT NULL THEN
            -- Turned on while this waited. Upgrading the shared lock could deadlock with
            -- another such caller; the change's own pass (and the sweep) fill the slots.
            job := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
    ELSE
        PERFORM aq_lock_global_v1();
        ceiling := aq_ceiling_v2();  -- after the wait
    END IF;

    FOREACH v_user IN ARRAY v_users LOOP
        PERFORM aq_lock_user_v1(v_user);
        IF ceiling IS NULL THEN
            -- Off (or turned off while this waited for the lock): the user's own slots.
            FOR v_job IN SELECT * FROM aq_fill_user_locked_v1(v_user) LOOP
                job := v_job;
                v_n := v_n + 1;
                RETURN NEXT;
            END LOOP;
        ELSE
            PERFORM aq_refresh_waits_locked_v1(v_user, ceiling);
        END IF;
    END LOOP;
    WHILE ceiling IS NOT NULL AND v_n < p_max LOOP
        SELECT q.id, q.user_id INTO v_pick FROM analysis_jobs q
         WHERE q.status = 'queued' AND q.waiting_for = 'provider_capacity'
           AND q.id <> ALL (v_skipped)
         ORDER BY q.turn_key, q.queue_seq
         LIMIT 1;
        EXIT WHEN NOT FOUND;
        PERFORM aq_lock_user_v1(v_pick.user_id);
        -- A fresh statement: sees what the user's last lock holder committed.
        v_job := aq_start_locked_v1(v_pick.user_id, v_pick.id, ceiling);
        IF v_job.id IS NULL THEN
            IF NOT EXISTS (SELECT 1 FROM analysis_jobs a
                            WHERE a.status IN ('pending', 'running')
                           HAVING count(*) < ceiling) THEN
                EXIT;  -- full
            END IF;
            v_skipped := v_skipped || v_pick.id;  -- the pick was stale; its waits are fixed
            CONTINUE;
        END IF;
        job := v_job;
        v_n := v_n + 1;
        RETURN NEXT;
    END LOOP;
    IF v_n = 0 THEN
        job := NULL;
        RETURN NEXT;
    END IF;
END
$$;


-- A wake-up (a notification about p_users' jobs): fill what it left to fill, and name the
-- pending jobs of p_users nobody is releasing. Reads without a lock first, so the usual wake
-- (the change already filled its own slot, or freed none) costs a few index lookups and takes
-- no lock; only users with room and a queued head that should move, or with the ceiling on a
-- free global slot and a ready job, go on to aq_promote_v2. Returns the ceiling in force and one
-- row per job: promoted by this call (promoted = true) or pending, unclaimed and due (false);
-- one row with job NULL when there is none. Simple statements per user, each planned once per
-- session: one query over the array was planned anew on every call (about 1 ms).
CREATE OR REPLACE FUNCTION aq_promote_woken_v1(
    p_users text[], p_max integer,
    OUT ceiling integer, OUT job analysis_jobs, OUT promoted boolean)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_user text;
    v_users text[] := '{}';
    v_woken text[];
    v_head text;
    v_limit integer;
    v_used integer[];
    v_ids uuid[] := '{}';
    v_row record;
    v_job analysis_jobs;
BEGIN
    ceiling := aq_ceiling_v2();
    SELECT coalesce(array_agg(DISTINCT u ORDER BY u), '{}') INTO v_woken
      FROM unnest(p_users) u WHERE u IS NOT NULL;
    FOREACH v_user IN ARRAY v_woken LOOP
        -- Room (fewer active first-pass jobs than the limit) and a head that does not wait
        -- for the provider (with the ceiling on, its wait is stale) ...
        SELECT q.waiting_for INTO v_head FROM analysis_jobs q
         WHERE q.user_id = v_user AND q.status = 'queued' AND q.delta_of_job_id IS NULL
         ORDER BY q.queue_seq
         LIMIT 1;
        IF FOUND AND (ceiling IS NULL OR v_head = 'your_previous_analysis') THEN
            SELECT s.max_running, s.used INTO v_limit, v_used FROM aq_user_slots_v1(v_user) s;
            IF cardinality(v_used) < v_limit THEN
                v_users := v_users || v_user;
                CONTINUE;
            END IF;
        END IF;
        -- ... or, ceiling off, a delta still waiting for capacity.
        IF ceiling IS NULL AND EXISTS (
                SELECT 1 FROM analysis_jobs d
                 WHERE d.user_id = v_user AND d.status = 'queued'
                   AND d.waiting_for = 'provider_capacity' AND d.delta_of_job_id IS NOT NULL) THEN
            v_users := v_users || v_user;
        END IF;
    END LOOP;
    IF cardinality(v_users) > 0 OR (
            ceiling IS NOT NULL
            AND EXISTS (SELECT 1 FROM analysis_jobs r
                         WHERE r.status = 'queued' AND r.waiting_for = 'provider_capacity')
            AND (SELECT count(*) FROM analysis_jobs a
                  WHERE a.status IN ('pending', 'running')) < ceiling) THEN
        FOR v_row IN SELECT * FROM aq_promote_v2(v_users, p_max) LOOP
            ceiling := v_row.ceiling;
            CONTINUE WHEN (v_row.job).id IS NULL;
            job := v_row.job;
            promoted := true;
            v_ids := v_ids || job.id;
            RETURN NEXT;
        END LOOP;
    END IF;
    FOREACH v_user IN ARRAY v_woken LOOP
        -- First-pass jobs through the user's slots, deltas through the open work (the user's
        -- history is never read).
        FOR v_job IN
            SELECT j.* FROM analysis_jobs j
             WHERE j.user_id = v_user AND j.status IN ('pending', 'running')
               AND j.delta_of_job_id IS NULL AND j.status = 'pending'
               AND (j.claim_expires_at IS NULL OR j.claim_expires_at < clock_timestamp())
               AND (j.next_release_at IS NULL OR j.next_release_at <= clock_timestamp())
            UNION ALL
            SELECT j.* FROM analysis_jobs j
             WHERE j.status = 'pending' AND j.delta_of_job_id IS NOT NULL AND j.user_id = v_user
               AND (j.claim_expires_at IS NULL OR j.claim_expires_at < clock_timestamp())
               AND (j.next_release_at IS NULL OR j.next_release_at <= clock_timestamp())
        LOOP
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
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
BEGIN
    PERFORM aq_lock_global_v1();
    UPDATE queue_settings
       SET global_max_running = p_ceiling, updated_at = clock_timestamp()
     WHERE global_max_running IS DISTINCT FROM p_ceiling;
    RETURN p_ceiling;
END
$$;

-- Set a user's concurrency (NULL: back to the default of 1) and fill or re-derive what it
-- changes. Returns the jobs promoted (ceiling off), at most limit - active.
CREATE OR REPLACE FUNCTION aq_set_user_limit_v1(p_user_id text, p_max_running integer)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_ceiling integer := aq_ceiling_v2();
BEGIN
    IF v_ceiling IS NULL THEN
        -- Ceiling off: held shared until commit, so turning it on waits for this decision.
        PERFORM aq_lock_global_shared_v1();
        v_ceiling := aq_ceiling_v2();
    END IF;
    PERFORM aq_lock_user_v1(p_user_id);
    IF p_max_running IS NULL THEN
        DELETE FROM user_limits WHERE user_id = p_user_id;
    ELSE
        INSERT INTO user_limits AS l (user_id, max_running) VALUES (p_user_id, p_max_running)
        ON CONFLICT (user_id) DO UPDATE
            SET max_running = EXCLUDED.max_running, updated_at = clock_timestamp();
    END IF;
    IF v_ceiling IS NULL THEN
        RETURN QUERY SELECT * FROM aq_fill_user_locked_v1(p_user_id);
    ELSE
        PERFORM aq_refresh_waits_locked_v1(p_user_id, v_ceiling);
    END IF;
END
$$;
