-- 0008_provider_ceiling: per-user limits, a global ceiling on running analyses, fair turns.
--
-- Slots. An active (pending/running) first-pass job holds a numbered *user slot*, unique per
-- user; with the ceiling on, every active job also holds a numbered *global slot*, unique
-- across the table. Both are handed out only from 1..limit, under the locks below, and the
-- unique partial indexes make a second holder of a number impossible whatever the code does.
-- A slot belongs to a job, never to an instance: it frees in the transaction that moves the job
-- to a terminal status. A job an instance left behind (a crash mid-release, a lost callback) is
-- picked up by the sweep (claim lease, polling), which ends it and so frees its slot.
--
-- Lock order, everywhere: the global lock (aq_lock_global_v1), then user locks
-- (aq_lock_user_v1). Nothing waits for the global lock while holding a user lock. Admission
-- only *tries* it (pg_try_advisory_xact_lock never waits) to start its own user's job when it
-- is the fairest; completion starts its user's next job, when that is the fairest, in the very
-- slot it frees (no other transaction can see that slot free before the commit), holding the
-- global lock *shared* by a try, so that concurrent completions do not exclude each other but
-- a change of the ceiling waits for them. Both read the ceiling again once they hold the lock.
-- When a try fails, they leave the slot to a promotion pass.
--   * ceiling on:  a promotion pass takes the global lock exclusively, then one user at a time.
--   * ceiling off: every queue decision takes the global lock *shared* before its user lock
--     (aq_ceiling_v1), so turning the ceiling on waits for decisions made under "off" and none
--     can overshoot it.
--
-- Fair turns. A queued job waits for 'your_previous_analysis' (its user is at their limit) or
-- for 'provider_capacity' (its user has room; the ceiling is full). The latter are *ready* and
-- carry a turn_key: when the user last started a job or when the job was admitted, whichever
-- is later. A free global slot goes to the smallest (turn_key, queue_seq): the user who has
-- waited longest since their last start. Starting a job moves the user's other ready jobs to
-- turn_key = now, behind everyone waiting: round robin. Deltas wait with turn_key -infinity,
-- ahead of every first-pass job, oldest first.

CREATE TABLE queue_settings (
    id                  boolean PRIMARY KEY DEFAULT true CHECK (id),
    -- NULL: no global ceiling. Written at start by each instance from AQ_GLOBAL_MAX_RUNNING.
    global_max_running  integer CHECK (global_max_running BETWEEN 1 AND 1000000),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO queue_settings DEFAULT VALUES;

-- Per-user concurrency for plans that allow more than one analysis at once (admin API).
CREATE TABLE user_limits (
    user_id      text PRIMARY KEY CHECK (length(user_id) BETWEEN 1 AND 200),
    max_running  integer NOT NULL CHECK (max_running BETWEEN 1 AND 100),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- When each user last started a first-pass job with the ceiling on: the round robin's memory.
CREATE TABLE user_turns (
    user_id       text PRIMARY KEY,
    last_turn_at  timestamptz NOT NULL
);

ALTER TABLE analysis_jobs
    ADD COLUMN user_slot    integer,
    ADD COLUMN global_slot  integer,
    ADD COLUMN waiting_for  text,
    ADD COLUMN turn_key     timestamptz;

-- Open work only: the jobs active and queued now.
UPDATE analysis_jobs SET user_slot = 1
 WHERE status IN ('pending', 'running') AND delta_of_job_id IS NULL;
UPDATE analysis_jobs SET waiting_for = 'your_previous_analysis' WHERE status = 'queued';

ALTER TABLE analysis_jobs
    DROP CONSTRAINT analysis_jobs_delta_never_queued,
    ADD CONSTRAINT analysis_jobs_user_slot_range CHECK (user_slot BETWEEN 1 AND 100),
    ADD CONSTRAINT analysis_jobs_global_slot_range CHECK (global_slot BETWEEN 1 AND 1000000),
    ADD CONSTRAINT analysis_jobs_active_has_user_slot CHECK (
        status NOT IN ('pending', 'running') OR delta_of_job_id IS NOT NULL
        OR user_slot IS NOT NULL),
    ADD CONSTRAINT analysis_jobs_waiting_for CHECK (
        (status = 'queued') = (waiting_for IS NOT NULL)
        AND waiting_for IN ('your_previous_analysis', 'provider_capacity')),
    ADD CONSTRAINT analysis_jobs_ready_has_turn CHECK (
        (waiting_for IS NOT DISTINCT FROM 'provider_capacity') = (turn_key IS NOT NULL)),
    -- A delta never waits behind its user's queue, only for the provider.
    ADD CONSTRAINT analysis_jobs_delta_waits_for_capacity CHECK (
        delta_of_job_id IS NULL OR status <> 'queued' OR waiting_for = 'provider_capacity');

-- A user's queue is their queued first-pass jobs: a delta that waits (for capacity only) is not
-- in it. Narrowing the index, and carrying each job's wait in it, keeps the queue's counts,
-- heads and the sweep's scan index-only, whatever the history.
DROP INDEX analysis_jobs_queued;
CREATE INDEX analysis_jobs_queued
    ON analysis_jobs (user_id, queue_seq) INCLUDE (waiting_for)
    WHERE status = 'queued' AND delta_of_job_id IS NULL;

-- The per-user invariant, generalised: no two active first-pass jobs of a user share a slot.
-- With the default limit of 1 this is exactly the index it replaces.
DROP INDEX analysis_jobs_one_active_first_pass;
CREATE UNIQUE INDEX analysis_jobs_user_slot
    ON analysis_jobs (user_id, user_slot)
    WHERE status IN ('pending', 'running') AND delta_of_job_id IS NULL;

-- The global invariant: no two active jobs share a global slot.
CREATE UNIQUE INDEX analysis_jobs_global_slot
    ON analysis_jobs (global_slot)
    WHERE status IN ('pending', 'running') AND global_slot IS NOT NULL;

-- The turn order: ready jobs, fairest first. Holds only what waits for capacity.
CREATE INDEX analysis_jobs_turns
    ON analysis_jobs (turn_key, queue_seq)
    WHERE status = 'queued' AND waiting_for = 'provider_capacity';

CREATE INDEX analysis_jobs_ready_by_user
    ON analysis_jobs (user_id, queue_seq)
    WHERE status = 'queued' AND waiting_for = 'provider_capacity';

-- The one place the global key is spelled. Its text cannot equal a user key: those are the
-- queue's prefix and a colon, then the user id (aq_lock_user_v1).
CREATE FUNCTION aq_lock_global_v1() RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

CREATE FUNCTION aq_lock_global_shared_v1() RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

CREATE FUNCTION aq_try_lock_global_v1() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

CREATE FUNCTION aq_try_lock_global_shared_v1() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock_shared(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

-- The ceiling in force, read while holding the global lock in some mode: no change of it can
-- commit before this transaction ends.
CREATE FUNCTION aq_ceiling_held_v1() RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT s.global_max_running FROM queue_settings s
$$;

-- The ceiling a queue decision must obey (NULL: off). Call it before any user lock. With the
-- ceiling off it returns holding the global lock shared: a change of the ceiling waits for this
-- transaction, and this one, having waited, reads the new value.
CREATE FUNCTION aq_ceiling_v1() RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ceiling integer;
BEGIN
    SELECT s.global_max_running INTO v_ceiling FROM queue_settings s;
    IF v_ceiling IS NULL THEN
        PERFORM aq_lock_global_shared_v1();
        SELECT s.global_max_running INTO v_ceiling FROM queue_settings s;
    END IF;
    RETURN v_ceiling;
END
$$;

CREATE FUNCTION aq_user_limit_v1(p_user_id text) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT l.max_running FROM user_limits l WHERE l.user_id = p_user_id), 1)
$$;

-- Lock held. The user's limit and the user slots their active first-pass jobs hold.
CREATE FUNCTION aq_user_slots_v1(p_user_id text, OUT max_running integer, OUT used integer[])
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT l.max_running FROM user_limits l WHERE l.user_id = p_user_id), 1),
           coalesce(array_agg(a.user_slot), '{}')
      FROM analysis_jobs a
     WHERE a.user_id = p_user_id AND a.status IN ('pending', 'running')
       AND a.delta_of_job_id IS NULL
$$;

-- Lock held. The lowest user slot free for p_user_id within its limit, or NULL at the limit.
CREATE FUNCTION aq_free_user_slot_v1(p_user_id text) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_used integer[];
    v_limit integer;
BEGIN
    SELECT s.max_running, s.used INTO v_limit, v_used FROM aq_user_slots_v1(p_user_id) s;
    -- Active jobs count against the limit whatever their numbers (a lowered limit).
    IF cardinality(v_used) >= v_limit THEN
        RETURN NULL;
    END IF;
    FOR s IN 1..v_limit LOOP  -- simple expressions: no query per step
        IF NOT s = ANY (v_used) THEN
            RETURN s;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- User lock held. Keep the waits of the user's queued first-pass jobs true: with the ceiling
-- on, the first (limit - active) wait for provider_capacity with their turn key, the rest for
-- your_previous_analysis; with it off, all wait for your_previous_analysis (a free slot is
-- filled at once). Writes only rows whose wait changes, so it is cheap when nothing does.
CREATE FUNCTION aq_refresh_waits_locked_v1(p_user_id text, p_ceiling integer) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_free integer := 0;
    v_last timestamptz;
    v_head uuid[];
BEGIN
    IF p_ceiling IS NOT NULL THEN
        SELECT aq_user_limit_v1(p_user_id) - count(*) INTO v_free FROM analysis_jobs a
         WHERE a.user_id = p_user_id AND a.status IN ('pending', 'running')
           AND a.delta_of_job_id IS NULL;
        SELECT t.last_turn_at INTO v_last FROM user_turns t WHERE t.user_id = p_user_id;
    END IF;
    SELECT coalesce(array_agg(h.id), '{}') INTO v_head FROM (
        SELECT q.id FROM analysis_jobs q
         WHERE q.user_id = p_user_id AND q.status = 'queued' AND q.delta_of_job_id IS NULL
         ORDER BY q.queue_seq
         LIMIT greatest(v_free, 0)) h;
    UPDATE analysis_jobs j
       SET waiting_for = 'provider_capacity',
           turn_key = greatest(v_last, j.created_at),
           updated_at = clock_timestamp()
     WHERE j.id = ANY (v_head) AND j.status = 'queued'
       AND (j.waiting_for, j.turn_key) IS DISTINCT FROM
           ('provider_capacity', greatest(v_last, j.created_at));
    UPDATE analysis_jobs j
       SET waiting_for = 'your_previous_analysis', turn_key = NULL,
           updated_at = clock_timestamp()
     WHERE j.user_id = p_user_id AND j.status = 'queued' AND j.waiting_for = 'provider_capacity'
       AND j.delta_of_job_id IS NULL AND j.id <> ALL (v_head);
END
$$;

-- User lock held, ceiling off. Start the user's waiting deltas, then fill their free slots from
-- the head of their queue, in order. Returns the jobs promoted.
CREATE FUNCTION aq_fill_user_locked_v1(p_user_id text) RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_limit integer;
    v_used integer[];
    v_free integer;
    v_slot integer;
    v_job analysis_jobs;
BEGIN
    -- What waited for capacity under a ceiling that was just turned off: deltas start at once,
    -- first-pass jobs wait for their user again (the fill below starts those with room). One
    -- statement, usually on no row.
    FOR v_job IN
        UPDATE analysis_jobs j
           SET status = CASE WHEN j.delta_of_job_id IS NULL THEN 'queued' ELSE 'pending' END,
               waiting_for = CASE WHEN j.delta_of_job_id IS NULL
                                  THEN 'your_previous_analysis' END,
               turn_key = NULL,
               promoted_at = CASE WHEN j.delta_of_job_id IS NULL THEN NULL
                                  ELSE clock_timestamp() END,
               updated_at = clock_timestamp()
         WHERE j.user_id = p_user_id AND j.status = 'queued' AND j.waiting_for = 'provider_capacity'
        RETURNING j.*
    LOOP
        IF v_job.status = 'pending' THEN
            RETURN NEXT v_job;
        END IF;
    END LOOP;
    SELECT s.max_running, s.used INTO v_limit, v_used FROM aq_user_slots_v1(p_user_id) s;
    v_free := v_limit - cardinality(v_used);  -- active jobs count whatever their numbers
    FOR v_slot IN 1..v_limit LOOP
        EXIT WHEN v_free <= 0;
        CONTINUE WHEN v_slot = ANY (v_used);
        -- status = 'queued' is repeated outside the subquery: after a row-lock wait READ
        -- COMMITTED re-checks only the outer WHERE; a job cancelled meanwhile stays cancelled.
        UPDATE analysis_jobs j
           SET status = 'pending', user_slot = v_slot, waiting_for = NULL, turn_key = NULL,
               promoted_at = clock_timestamp(), updated_at = clock_timestamp()
         WHERE j.id = (
                SELECT q.id FROM analysis_jobs q
                 WHERE q.user_id = p_user_id AND q.status = 'queued'
                   AND q.delta_of_job_id IS NULL
                 ORDER BY q.queue_seq
                 LIMIT 1)
           AND j.status = 'queued'
        RETURNING j.* INTO v_job;
        EXIT WHEN NOT FOUND;
        v_free := v_free - 1;
        RETURN NEXT v_job;
    END LOOP;
END
$$;

-- The user's lock held, ceiling on, and either the global lock held (exclusively or by a
-- successful try) or p_slot given: the global slot this transaction just freed, which nobody
-- else can see free before it commits, so taking it again needs no allocation and no lock.
-- Start one ready job of p_user_id: p_job_id when it is a delta, else the user's oldest queued
-- first-pass job. NULL when it cannot start (no global slot, no user slot, nothing ready).
CREATE FUNCTION aq_start_locked_v1(p_user_id text, p_job_id uuid, p_ceiling integer,
                                   p_slot integer DEFAULT NULL)
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
CREATE FUNCTION aq_start_own_if_fairest_v1(p_user_id text, p_ceiling integer,
                                           p_slot integer DEFAULT NULL)
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
CREATE FUNCTION aq_promote_v2(p_users text[], p_max integer,
                              OUT ceiling integer, OUT job analysis_jobs)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE AS $$
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
    SELECT s.global_max_running INTO ceiling FROM queue_settings s;
    IF ceiling IS NULL THEN
        PERFORM aq_lock_global_shared_v1();
        SELECT s.global_max_running INTO ceiling FROM queue_settings s;
        IF ceiling IS NOT NULL THEN
            -- Turned on while this waited. Upgrading the shared lock could deadlock with
            -- another such caller; the change's own pass (and the sweep) fill the slots.
            job := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
    ELSE
        PERFORM aq_lock_global_v1();
        SELECT s.global_max_running INTO ceiling FROM queue_settings s;  -- after the wait
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

-- Set the ceiling (NULL: off). Waits for every decision in flight under the old value. The
-- caller then runs promotion passes to fill what a raise (or turning it off) freed.
CREATE FUNCTION aq_set_ceiling_v1(p_ceiling integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
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
CREATE FUNCTION aq_set_user_limit_v1(p_user_id text, p_max_running integer)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ceiling integer := aq_ceiling_v1();
BEGIN
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

-- Lock held: the v1 entry points keep their signatures (instances of the previous version
-- call them during a rolling deploy) and follow the new rules.
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

-- Admit: under the user lock, debit and insert the job whose status is the write-up's CASE,
-- now with the user's limit and the ceiling:
--   ceiling off: a delta is pending; a first-pass job is pending when nothing of the user's
--     waits and a user slot is free, else queued for your_previous_analysis.
--   ceiling on:  the job is queued; its wait is derived like every other; if the global lock
--     is free (tried, never waited for) and the job's user is the fairest, it starts at once.
-- Raises AQ402 (insufficient credits) or AQ410 (the reservation was reclaimed by the sweep);
-- either rolls the whole admit back. Returns the job and, when queued, its position.
CREATE OR REPLACE FUNCTION aq_admit_v1(
    p_job_id uuid, p_user_id text, p_run_id uuid, p_core_run_id text,
    p_thesis jsonb, p_sources jsonb, p_cost integer, p_delta_of uuid,
    p_idempotency_key text, p_request_hash text,
    OUT job analysis_jobs, OUT queue_position bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_ceiling integer := aq_ceiling_v1();
    v_now timestamptz;
    v_status text := 'queued';
    v_slot integer;
    v_wait text;
    v_turn timestamptz;
    v_room integer;
    v_started analysis_jobs;
BEGIN
    PERFORM aq_lock_user_v1(p_user_id);

    DELETE FROM core_run_reservations WHERE run_id = p_run_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run reservation % no longer exists', p_run_id USING ERRCODE = 'AQ410';
    END IF;

    IF p_cost > 0 THEN
        UPDATE credit_accounts
           SET balance = balance - p_cost, updated_at = clock_timestamp()
         WHERE user_id = p_user_id AND balance >= p_cost;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'insufficient credits' USING ERRCODE = 'AQ402';
        END IF;
    END IF;

    v_now := clock_timestamp();
    IF p_delta_of IS NOT NULL THEN
        IF v_ceiling IS NULL THEN
            v_status := 'pending';
        ELSE
            v_wait := 'provider_capacity';
            v_turn := '-infinity';
        END IF;
    ELSIF v_ceiling IS NULL THEN
        IF NOT EXISTS (SELECT 1 FROM analysis_jobs b
                        WHERE b.user_id = p_user_id AND b.status = 'queued'
                          AND b.delta_of_job_id IS NULL) THEN
            v_slot := aq_free_user_slot_v1(p_user_id);
        END IF;
        IF v_slot IS NOT NULL THEN
            v_status := 'pending';
        ELSE
            v_wait := 'your_previous_analysis';
        END IF;
    ELSE
        -- Ready (waiting only for the provider) when the user's slots outnumber what is
        -- active and queued ahead of it.
        SELECT aq_user_limit_v1(p_user_id) - count(*) INTO v_room FROM analysis_jobs b
         WHERE b.user_id = p_user_id AND b.status IN ('queued', 'pending', 'running')
           AND b.delta_of_job_id IS NULL;
        IF v_room > 0 THEN
            v_wait := 'provider_capacity';
            v_turn := greatest(
                (SELECT t.last_turn_at FROM user_turns t WHERE t.user_id = p_user_id), v_now);
        ELSE
            v_wait := 'your_previous_analysis';
        END IF;
    END IF;

    INSERT INTO analysis_jobs
        (id, user_id, run_id, core_run_id, status, delta_of_job_id, thesis, sources, cost,
         idempotency_key, request_hash, created_at, updated_at, promoted_at, user_slot,
         waiting_for, turn_key)
    VALUES
        (p_job_id, p_user_id, p_run_id, p_core_run_id, v_status, p_delta_of, p_thesis,
         p_sources, p_cost, p_idempotency_key, p_request_hash, v_now, v_now,
         CASE WHEN v_status = 'pending' THEN v_now END, v_slot, v_wait, v_turn)
    RETURNING * INTO job;

    IF p_cost > 0 THEN
        INSERT INTO credit_ledger (user_id, job_id, kind, amount)
        VALUES (p_user_id, p_job_id, 'debit', p_cost);
    END IF;

    -- Nested, not AND: PL/pgSQL evaluates both sides of NULL AND f(), and a try that succeeds
    -- holds the global lock to commit.
    -- The ceiling read above may have changed since (it was read without a lock): holding the
    -- global lock, read it again. Turned off meanwhile: fill as "off" does.
    IF v_wait = 'provider_capacity' THEN
        IF aq_try_lock_global_v1() THEN
            v_ceiling := aq_ceiling_held_v1();
            IF v_ceiling IS NULL THEN
                SELECT f.* INTO v_started FROM aq_fill_user_locked_v1(p_user_id) f LIMIT 1;
            ELSE
                v_started := aq_start_own_if_fairest_v1(p_user_id, v_ceiling);
            END IF;
            SELECT j.* INTO job FROM analysis_jobs j WHERE j.id = p_job_id;
        END IF;
    END IF;
    -- Counted here, in a statement of its own under the lock, so the answer to the click
    -- carries its true position without another round trip.
    IF job.status = 'queued' AND job.delta_of_job_id IS NULL THEN
        SELECT count(*) INTO queue_position FROM analysis_jobs q
         WHERE q.user_id = p_user_id AND q.status = 'queued' AND q.queue_seq <= job.queue_seq
           AND q.delta_of_job_id IS NULL;
    END IF;
END
$$;

-- Move a job to a terminal status (and/or soft-delete it) under its user's lock, refund what
-- never reached judging, and fill the slot it frees:
--   ceiling off: promote the user's next job in this transaction (tail promotion);
--   ceiling on:  re-derive the user's waits, and start the fairest ready job if it is this
--                user's, in the global slot the job frees (or, for a job that held none, if
--                the global lock is free); otherwise the completion's NOTIFY makes a promotion
--                pass give the slot to whoever's turn it is.
-- (Parameters and refunds as before; see 0002.)
CREATE OR REPLACE FUNCTION aq_finish_v1(
    p_job_id uuid, p_core_run_id text, p_user_id text,
    p_status text, p_from text[], p_delete boolean,
    p_error_code text, p_error_detail text, p_verdicts jsonb, p_ran boolean,
    OUT job analysis_jobs, OUT old_status text, OUT changed boolean,
    OUT promoted analysis_jobs)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_user text;
    v_id uuid;
    v_ceiling integer;
BEGIN
    changed := false;
    IF p_job_id IS NOT NULL THEN
        SELECT j.user_id, j.id INTO v_user, v_id FROM analysis_jobs j
         WHERE j.id = p_job_id AND (p_user_id IS NULL OR j.user_id = p_user_id);
    ELSE
        SELECT j.user_id, j.id INTO v_user, v_id FROM analysis_jobs j
         WHERE j.core_run_id = p_core_run_id AND (p_user_id IS NULL OR j.user_id = p_user_id);
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    v_ceiling := aq_ceiling_v1();
    PERFORM aq_lock_user_v1(v_user);
    -- The row lock pins old_status: the dispatcher's pending -> running does not take the
    -- user lock.
    SELECT j.* INTO job FROM analysis_jobs j WHERE j.id = v_id FOR UPDATE;
    old_status := job.status;

    IF p_status IS NOT NULL AND job.status = ANY (p_from) THEN
        UPDATE analysis_jobs j
           SET status = p_status,
               finished_at = clock_timestamp(),
               started_at = CASE WHEN p_ran THEN coalesce(j.started_at, clock_timestamp())
                                 ELSE j.started_at END,
               updated_at = clock_timestamp(),
               deleted_at = CASE WHEN p_delete THEN clock_timestamp() ELSE j.deleted_at END,
               error_code = p_error_code,
               error_detail = p_error_detail,
               verdicts = coalesce(p_verdicts, j.verdicts),
               waiting_for = NULL, turn_key = NULL,
               claimed_by = NULL, claim_expires_at = NULL, next_release_at = NULL
         WHERE j.id = v_id
        RETURNING j.* INTO job;
        changed := true;

        IF job.cost > 0 AND (p_status = 'failed'
                             OR (p_status = 'cancelled' AND old_status IN ('queued', 'pending'))) THEN
            INSERT INTO credit_ledger (user_id, job_id, kind, amount)
            VALUES (job.user_id, job.id, 'refund', job.cost)
            ON CONFLICT (job_id) WHERE kind = 'refund' DO NOTHING;
            IF FOUND THEN
                UPDATE credit_accounts
                   SET balance = balance + job.cost, updated_at = clock_timestamp()
                 WHERE user_id = job.user_id;
            END IF;
        END IF;
    ELSIF p_delete AND job.deleted_at IS NULL
          AND job.status IN ('succeeded', 'failed', 'cancelled') THEN
        UPDATE analysis_jobs j
           SET deleted_at = clock_timestamp(), updated_at = clock_timestamp()
         WHERE j.id = v_id
        RETURNING j.* INTO job;
        changed := true;
    END IF;

    IF NOT changed THEN
        RETURN;
    END IF;
    IF v_ceiling IS NULL THEN
        IF job.delta_of_job_id IS NULL THEN
            promoted := aq_promote_locked_v1(v_user);
        END IF;
    ELSIF old_status IN ('queued', 'pending', 'running') THEN
        PERFORM aq_refresh_waits_locked_v1(v_user, v_ceiling);
        -- Starting the user's next job here needs the ceiling as it is now (read above without
        -- a lock): hold the global lock (shared to reuse the slot this frees, which nobody
        -- else can see free before the commit; exclusive to allocate one), then read it again.
        -- A try never waits; when it fails, a pass (woken by this commit's NOTIFY) decides.
        IF old_status <> 'queued' AND job.global_slot IS NOT NULL THEN
            IF aq_try_lock_global_shared_v1() THEN
                v_ceiling := aq_ceiling_held_v1();
                IF v_ceiling IS NOT NULL THEN
                    promoted := aq_start_own_if_fairest_v1(v_user, v_ceiling, job.global_slot);
                END IF;
            END IF;
        ELSIF old_status <> 'queued' THEN
            IF aq_try_lock_global_v1() THEN
                v_ceiling := aq_ceiling_held_v1();
                IF v_ceiling IS NOT NULL THEN
                    promoted := aq_start_own_if_fairest_v1(v_user, v_ceiling);
                END IF;
            END IF;
        END IF;
    END IF;
END
$$;
