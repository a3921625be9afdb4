-- The previous release (0.1): what only its instances call, and the helpers its function
-- bodies called.
--
-- During a rolling deploy the old instances keep calling the entry points their queries.sql
-- names, and their SQL keeps the signatures they were written against (docs/operations.md,
-- "Schema changes"). Each entry point here keeps such a signature and now calls the one
-- function of its decision. Applied after sql/functions/ (store/sqlfiles.py), so each one is
-- replaced in the transaction that drops what it called before, and never calls a function
-- that is not there yet. Drop them all in the first numbered migration released after every
-- 0.1 instance is gone.

-- 0.1's reservation (queries.sql "reserve"): one click of aq_reserve_v2, which holds its cost.
CREATE OR REPLACE FUNCTION aq_reserve_v1(
    p_user_id text, p_run_id uuid, p_job_id uuid, p_cost integer,
    p_thesis jsonb, p_sources jsonb, p_idempotency_key text, p_request_hash text,
    OUT outcome text, OUT job_id uuid, OUT balance bigint)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
BEGIN
    SELECT r.outcome, r.job_id, r.balance INTO outcome, job_id, balance
      FROM aq_reserve_v2(jsonb_build_array(jsonb_build_object(
               'item', 1, 'user_id', p_user_id, 'run_id', p_run_id, 'job_id', p_job_id,
               'cost', p_cost, 'thesis', p_thesis, 'sources', p_sources,
               'idempotency_key', p_idempotency_key, 'request_hash', p_request_hash))) r;
END
$$;

-- 0.1's admit (queries.sql "admit"): one click of aq_admit_v3, its refusals raised as 0.1 did
-- (AQ402 insufficient credits, AQ410 the reservation was reclaimed by the sweep).
CREATE OR REPLACE FUNCTION aq_admit_v1(
    p_job_id uuid, p_user_id text, p_run_id uuid, p_core_run_id text,
    p_thesis jsonb, p_sources jsonb, p_cost integer, p_delta_of uuid,
    p_idempotency_key text, p_request_hash text,
    OUT job analysis_jobs, OUT queue_position bigint)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v record;
BEGIN
    SELECT * INTO v
      FROM aq_admit_v3(jsonb_build_array(jsonb_build_object(
               'item', 1, 'job_id', p_job_id, 'user_id', p_user_id, 'run_id', p_run_id,
               'core_run_id', p_core_run_id, 'thesis', p_thesis, 'sources', p_sources,
               'cost', p_cost, 'delta_of', p_delta_of, 'idempotency_key', p_idempotency_key,
               'request_hash', p_request_hash)), NULL, NULL) a;
    IF v.outcome = 'reservation_gone' THEN
        RAISE EXCEPTION 'run reservation % no longer exists', p_run_id USING ERRCODE = 'AQ410';
    ELSIF v.outcome = 'insufficient_credits' THEN
        RAISE EXCEPTION 'insufficient credits' USING ERRCODE = 'AQ402';
    END IF;
    job := v.job;
    queue_position := v.queue_position;
END
$$;

-- 0.1's finish (queries.sql "finish"): one item of aq_finish_v3.
CREATE OR REPLACE FUNCTION aq_finish_v1(
    p_job_id uuid, p_core_run_id text, p_user_id text,
    p_status text, p_from text[], p_delete boolean,
    p_error_code text, p_error_detail text, p_verdicts jsonb, p_ran boolean,
    OUT job analysis_jobs, OUT old_status text, OUT changed boolean,
    OUT promoted analysis_jobs)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v record;
BEGIN
    SELECT * INTO v
      FROM aq_finish_v3(jsonb_build_array(jsonb_build_object(
               'item', 1, 'job_id', p_job_id, 'core_run_id', p_core_run_id,
               'user_id', p_user_id, 'status', p_status, 'from', p_from, 'delete', p_delete,
               'error_code', p_error_code, 'error_detail', p_error_detail,
               'verdicts', p_verdicts, 'ran', p_ran)), NULL, NULL) f;
    job := v.job;
    old_status := v.old_status;
    changed := coalesce(v.changed, false);
    promoted := v.promoted[1];
END
$$;

-- 0.1's promotion pass (queries.sql "promote"): aq_promote_v4, claiming nothing.
CREATE OR REPLACE FUNCTION aq_promote_v2(
    p_users text[], p_max integer, OUT ceiling integer, OUT job analysis_jobs)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
BEGIN
    RETURN QUERY SELECT p.ceiling, p.job FROM aq_promote_v4(p_users, p_max, NULL, NULL) p;
END
$$;

-- 0.1's running marks (queries.sql "jobs_mark_running"): aq_mark_running_v3.
CREATE OR REPLACE FUNCTION aq_mark_running_v1(p_job_ids uuid[], p_instance text)
RETURNS SETOF analysis_jobs
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_moved uuid[];
BEGIN
    v_moved := ARRAY(SELECT m.job_id FROM aq_mark_running_v3(p_job_ids, p_instance) m);
    RETURN QUERY SELECT j.* FROM analysis_jobs j WHERE j.id = ANY (v_moved);
END
$$;

-- What 0.2's development made and replaced before it was released: nothing calls these.
DROP FUNCTION IF EXISTS aq_admit_v2(
    uuid, text, uuid, text, jsonb, jsonb, integer, uuid, text, text);
DROP FUNCTION IF EXISTS aq_admit_many_v1(jsonb, text, double precision);
DROP FUNCTION IF EXISTS aq_admit_ceiling_off_locked_v1(jsonb);
DROP FUNCTION IF EXISTS aq_reserve_many_v1(jsonb);
DROP FUNCTION IF EXISTS aq_reservation_held_v1(uuid);
DROP FUNCTION IF EXISTS aq_finish_v2(
    uuid, text, text, text, text[], boolean, text, text, jsonb, boolean);
DROP FUNCTION IF EXISTS aq_finish_many_v1(jsonb, text, double precision);
DROP FUNCTION IF EXISTS aq_mark_running_v2(uuid[], text, boolean);
DROP FUNCTION IF EXISTS aq_batch_lock_wait_ms_v1();
DROP FUNCTION IF EXISTS aq_try_lock_user_v1(text);

-- The helpers 0.1's function bodies called. Those bodies are all replaced above or by
-- sql/functions/, so nothing calls these any more; they are kept as 0.1 left them, as every
-- name 0.1 defined must stay defined while its instances run.

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

-- Lock held. The user's limit and the user slots their active first-pass jobs hold.
-- PL/pgSQL: a LANGUAGE sql function with OUT parameters is never inlined, so it would be parsed
-- and planned on every call (it was the largest single cost of the drain, docs/benchmarks.md).
CREATE OR REPLACE FUNCTION aq_user_slots_v1(p_user_id text, OUT max_running integer,
                                            OUT used integer[])
LANGUAGE plpgsql STABLE AS $$
BEGIN
    max_running := coalesce(
        (SELECT l.max_running FROM user_limits l WHERE l.user_id = p_user_id), 1);
    SELECT coalesce(array_agg(a.user_slot), '{}') INTO used
      FROM analysis_jobs a
     WHERE a.user_id = p_user_id AND a.status IN ('pending', 'running')
       AND a.delta_of_job_id IS NULL;
END
$$;


-- Lock held. The lowest user slot free for p_user_id within its limit, or NULL at the limit.
CREATE OR REPLACE FUNCTION aq_free_user_slot_v1(p_user_id text) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_used integer[];
    v_limit integer;
BEGIN
    SELECT s.max_running, s.used INTO v_limit, v_used FROM aq_user_slots_v1(p_user_id) s;
    RETURN (aq_free_slots_v1(v_limit, v_used))[1];
END
$$;

-- User lock held. Keep the waits of the user's queued first-pass jobs true: with the ceiling
-- on, the first (limit - active) wait for provider_capacity with their turn key, the rest for
-- your_previous_analysis; with it off, all wait for your_previous_analysis (a free slot is
-- filled at once). Writes only rows whose wait changes, and runs an UPDATE only when the read
-- before it found such a row: usually none changes, and an UPDATE of no row still opens the
-- table's indexes and runs the change trigger (job_events.sql). Every writer of a user's queued
-- jobs holds the user's lock, so what the reads find stays true until the UPDATEs; each UPDATE
-- checks its rows again all the same.
CREATE OR REPLACE FUNCTION aq_refresh_waits_locked_v1(p_user_id text, p_ceiling integer)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_free integer := 0;
    v_last timestamptz;
    v_head uuid[];
    v_stale uuid[];
BEGIN
    IF p_ceiling IS NOT NULL THEN
        SELECT aq_user_limit_v1(p_user_id) - count(*) INTO v_free FROM analysis_jobs a
         WHERE a.user_id = p_user_id AND a.status IN ('pending', 'running')
           AND a.delta_of_job_id IS NULL;
        SELECT t.last_turn_at INTO v_last FROM user_turns t WHERE t.user_id = p_user_id;
    END IF;
    -- The heads (the first v_free queued), and those of them whose wait or turn is not yet so.
    SELECT coalesce(array_agg(h.id), '{}'), coalesce(array_agg(h.id) FILTER (WHERE h.stale), '{}')
      INTO v_head, v_stale
      FROM (SELECT q.id,
                   (q.waiting_for, q.turn_key) IS DISTINCT FROM
                   ('provider_capacity', greatest(v_last, q.created_at)) AS stale
              FROM analysis_jobs q
             WHERE q.user_id = p_user_id AND q.status = 'queued' AND q.delta_of_job_id IS NULL
             ORDER BY q.queue_seq
             LIMIT greatest(v_free, 0)) h;
    IF cardinality(v_stale) > 0 THEN
        UPDATE analysis_jobs j
           SET waiting_for = 'provider_capacity',
               turn_key = greatest(v_last, j.created_at),
               updated_at = clock_timestamp()
         WHERE j.id = ANY (v_stale) AND j.status = 'queued'
           AND (j.waiting_for, j.turn_key) IS DISTINCT FROM
               ('provider_capacity', greatest(v_last, j.created_at));
    END IF;
    -- The rest: no longer at the head, no longer waiting for capacity.
    IF EXISTS (SELECT 1 FROM analysis_jobs j
                WHERE j.user_id = p_user_id AND j.status = 'queued'
                  AND j.waiting_for = 'provider_capacity' AND j.delta_of_job_id IS NULL
                  AND j.id <> ALL (v_head)) THEN
        UPDATE analysis_jobs j
           SET waiting_for = 'your_previous_analysis', turn_key = NULL,
               updated_at = clock_timestamp()
         WHERE j.user_id = p_user_id AND j.status = 'queued'
           AND j.waiting_for = 'provider_capacity'
           AND j.delta_of_job_id IS NULL AND j.id <> ALL (v_head);
    END IF;
END
$$;

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
