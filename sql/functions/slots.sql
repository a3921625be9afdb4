-- slots: what a user may run, what the provider may run, and why a queued job waits.
--
-- An active (pending/running) first-pass job holds a numbered user slot, 1..its user's limit;
-- with the provider ceiling on, every active job also holds a numbered global slot, 1..the
-- ceiling. The unique indexes analysis_jobs_user_slot and analysis_jobs_global_slot make a
-- second holder of a number impossible whatever the code does. A slot belongs to a job, never
-- to an instance: it frees in the transaction that moves the job to a terminal status.
--
-- Fair turns. A queued job waits for 'your_previous_analysis' (its user is at their limit) or
-- for 'provider_capacity' (its user has room; the ceiling is full). The latter are *ready* and
-- carry a turn_key: when the user last started a job or when the job was admitted, whichever
-- is later. A free global slot goes to the smallest (turn_key, queue_seq): the user who has
-- waited longest since their last start. Starting a job moves the user's other ready jobs to
-- turn_key = now, behind everyone waiting: round robin. Deltas wait with turn_key -infinity,
-- ahead of every first-pass job, oldest first.

-- The ceiling as committed (NULL: off). Takes no lock: a decision that must not be overtaken by
-- a change of the ceiling holds the global lock in some mode first and reads it after
-- (docs/locking.md). PL/pgSQL, so its one statement is planned once per session.
CREATE OR REPLACE FUNCTION aq_ceiling_v2() RETURNS integer
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT s.global_max_running FROM queue_settings s);
END
$$;

-- A user's concurrency: their plan limit, or the default of 1.
CREATE OR REPLACE FUNCTION aq_user_limit_v1(p_user_id text) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT l.max_running FROM user_limits l WHERE l.user_id = p_user_id), 1)
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

-- The free slots in 1..p_limit that are not in p_used, lowest first, as many as the limit
-- leaves room for: active jobs count against it whatever their numbers (a lowered limit). Pure,
-- so that a batch can apply it to the slots its earlier decisions took (admit.sql) and a fill
-- to many users at once (promote.sql).
CREATE OR REPLACE FUNCTION aq_free_slots_v1(p_limit integer, p_used integer[])
RETURNS integer[]
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_free integer[] := '{}';
    v_room integer := p_limit - cardinality(p_used);
BEGIN
    FOR s IN 1..p_limit LOOP  -- simple expressions: no query per step
        EXIT WHEN cardinality(v_free) >= v_room;
        IF NOT s = ANY (p_used) THEN
            v_free := v_free || s;
        END IF;
    END LOOP;
    RETURN v_free;
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
