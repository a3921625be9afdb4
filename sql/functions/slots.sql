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
-- ahead of every first-pass job, oldest first. One function decides all of it for a set of
-- users: aq_place_locked_v2, below.

-- First pass: a job that is not a delta re-check. Only first-pass jobs hold user slots and
-- wait in their user's queue; a delta never queues behind them nor blocks them. Every query
-- says it through this function (inlined: the planner sees delta_of_job_id IS NULL and uses
-- the partial indexes, which spell it so since they were built).
CREATE OR REPLACE FUNCTION aq_first_pass_v1(p_delta_of uuid) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT p_delta_of IS NULL $$;

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

-- Whether admitting the clicks p_items may start a job: with the ceiling off, yes; with it
-- on, when the provider has a free slot and one click is a delta or its user holds or waits
-- for fewer first-pass jobs than their limit. Read without a lock, to pick G's mode
-- (aq_lock_decision_v2): clicks that queue behind their users' own jobs or behind a full
-- ceiling give out no global slot, so they need not wait for every other decision. The
-- placement decides under the locks; a click this guessed wrong about waits ready, and asks
-- for a pass.
CREATE OR REPLACE FUNCTION aq_may_start_v1(p_items jsonb) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_ceiling integer := aq_ceiling_v2();
BEGIN
    RETURN v_ceiling IS NULL OR (
        SELECT count(*) FROM analysis_jobs a WHERE a.status IN ('pending', 'running')
    ) < v_ceiling AND EXISTS (
        SELECT 1 FROM jsonb_to_recordset(p_items) AS x(user_id text, delta_of uuid)
         WHERE NOT aq_first_pass_v1(x.delta_of)
            OR (SELECT count(*) FROM analysis_jobs a
                 WHERE a.user_id = x.user_id AND a.status = 'queued'
                   AND aq_first_pass_v1(a.delta_of_job_id))
             + (SELECT count(*) FROM analysis_jobs a
                 WHERE a.user_id = x.user_id AND a.status IN ('pending', 'running')
                   AND aq_first_pass_v1(a.delta_of_job_id))
             < aq_user_limit_v1(x.user_id));
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


-- The placement rule, read only: where each queued job of p_users and each new job (p_new_*,
-- in item order, after everything queued) goes, given the global slots p_slots this decision
-- may give out (ceiling on; '{}' when it gives none). It is the write-up's CASE:
--
--   CASE WHEN first pass AND user_rank > user_room  THEN queued, your_previous_analysis
--        WHEN ceiling off OR global_rank <= free       THEN pending
--        ELSE                                               queued, provider_capacity END
--
-- user_rank: the job's place in its user's queue; user_room: their limit less what they run;
-- global_rank: its place in the fair order (the header) among the jobs whose users have room;
-- free: cardinality(p_slots). One row per job; moves: an existing job's place changes.
CREATE OR REPLACE FUNCTION aq_placements_v1(
    p_users text[], p_ceiling integer, p_slots integer[], p_now timestamptz,
    p_new_ids uuid[], p_new_users text[], p_new_deltas boolean[])
RETURNS TABLE (id uuid, user_id text, new boolean, delta boolean, seq bigint, status text,
               user_slot integer, global_slot integer, wait text, turn timestamptz,
               moves boolean)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY
    WITH u AS (
        SELECT x.u AS user_id, coalesce(l.max_running, 1) AS lim, t.last_turn_at,
               ARRAY(SELECT a.user_slot FROM analysis_jobs a
                      WHERE a.user_id = x.u AND a.status IN ('pending', 'running')
                        AND aq_first_pass_v1(a.delta_of_job_id)) AS used
          FROM unnest(p_users) AS x(u)
          LEFT JOIN user_limits l ON l.user_id = x.u
          LEFT JOIN user_turns t ON t.user_id = x.u),
    c AS (  -- the candidates: the queue (first pass), waiting deltas, then the new jobs
        SELECT q.id, q.user_id, false AS new, false AS delta, q.queue_seq AS seq, q.created_at,
               q.waiting_for, q.turn_key
          FROM u JOIN analysis_jobs q ON q.user_id = u.user_id
         WHERE q.status = 'queued' AND aq_first_pass_v1(q.delta_of_job_id)
        UNION ALL
        SELECT q.id, q.user_id, false, true, q.queue_seq, q.created_at, q.waiting_for, q.turn_key
          FROM u JOIN analysis_jobs q ON q.user_id = u.user_id
         WHERE q.status = 'queued' AND q.waiting_for = 'provider_capacity'
           AND NOT aq_first_pass_v1(q.delta_of_job_id)
        UNION ALL
        SELECT n.id, n.u, true, n.d, (1::bigint << 62) + n.k, p_now, NULL, NULL
          FROM unnest(p_new_ids, p_new_users, p_new_deltas) WITH ORDINALITY AS n(id, u, d, k)),
    r AS (
        SELECT c.*, u.lim, u.used, u.last_turn_at, u.lim - cardinality(u.used) AS room,
               CASE WHEN NOT c.delta THEN
                   row_number() OVER (PARTITION BY c.user_id, c.delta ORDER BY c.seq) END AS rank,
               greatest(u.last_turn_at, c.created_at) AS turn
          FROM c JOIN u ON u.user_id = c.user_id),
    ready AS (  -- the fair order: deltas oldest first, then round by round (rank), each round
                -- in the order of the users' first ready jobs
        SELECT r.id,
               row_number() OVER (ORDER BY r.delta DESC, coalesce(r.rank, 0), r.first_turn,
                                           r.first_seq) AS global_rank
          FROM (SELECT r.*,
                       CASE WHEN r.delta THEN '-infinity' ELSE first_value(r.turn) OVER w END
                           AS first_turn,
                       CASE WHEN r.delta THEN r.seq ELSE first_value(r.seq) OVER w END AS first_seq
                  FROM r WHERE r.delta OR r.rank <= r.room
                WINDOW w AS (PARTITION BY r.user_id, r.delta ORDER BY r.seq)) r),
    placed AS (
        SELECT r.*, g.global_rank,
               CASE WHEN NOT r.delta AND r.rank > r.room THEN 'your_previous_analysis'
                    WHEN p_ceiling IS NULL OR g.global_rank <= cardinality(p_slots) THEN NULL
                    ELSE 'provider_capacity' END AS w
          FROM r LEFT JOIN ready g ON g.id = r.id),
    started AS (
        SELECT p.*, bool_or(p.w IS NULL AND NOT p.delta) OVER (PARTITION BY p.user_id) AS starts
          FROM placed p),
    final AS (
        SELECT s.id, s.user_id, s.new, s.delta, s.seq,
               CASE WHEN s.w IS NULL THEN 'pending' ELSE 'queued' END AS status,
               CASE WHEN s.w IS NULL AND NOT s.delta
                    THEN (aq_free_slots_v1(s.lim, s.used))[s.rank] END AS user_slot,
               CASE WHEN s.w IS NULL AND p_ceiling IS NOT NULL
                    THEN p_slots[s.global_rank] END AS global_slot,
               s.w AS wait,
               CASE WHEN s.w = 'provider_capacity' THEN
                   CASE WHEN s.delta THEN '-infinity'::timestamptz
                        WHEN s.starts AND p_ceiling IS NOT NULL THEN greatest(p_now, s.created_at)
                        ELSE s.turn END END AS turn,
               s.waiting_for, s.turn_key
          FROM started s)
    SELECT f.id, f.user_id, f.new, f.delta, f.seq, f.status, f.user_slot, f.global_slot, f.wait,
           f.turn,
           NOT f.new AND (f.status = 'pending' OR (f.wait, f.turn) IS DISTINCT FROM
                                                    (f.waiting_for, f.turn_key))
      FROM final f;
END
$$;

-- Locks held for p_users (aq_lock_decision_v2): place their queued jobs and the new jobs
-- p_new_* by the rule above, giving out at most p_max global slots when p_allocates: the
-- lowest free numbers (G exclusive), or, given p_slots, those (numbers its own completions
-- freed, under G shared: aq_finish_v3). Writes the queued jobs whose place changes and the
-- turns of the users who started a job (ceiling on). Returns the jobs it started, the new
-- jobs' places in order (the caller inserts them), and whether capacity is left that a pass
-- must give out (a ceiling turned on meanwhile, or a ready user this decision did not lock).
DROP FUNCTION IF EXISTS aq_place_locked_v1(
    text[], integer, boolean, integer, uuid[], text[], boolean[]);
CREATE OR REPLACE FUNCTION aq_place_locked_v2(
    p_users text[], p_ceiling integer, p_allocates boolean, p_max integer, p_slots integer[],
    p_new_ids uuid[], p_new_users text[], p_new_deltas boolean[],
    OUT promoted analysis_jobs[], OUT new_status text[], OUT new_user_slot integer[],
    OUT new_global_slot integer[], OUT new_wait text[], OUT new_turn timestamptz[],
    OUT asks_pass boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_slots integer[] := '{}';
    m record;
BEGIN
    IF p_ceiling IS NOT NULL AND p_allocates AND p_slots IS NOT NULL THEN
        v_slots := p_slots;
    ELSIF p_ceiling IS NOT NULL AND p_allocates THEN  -- the lowest free numbers
        v_slots := ARRAY(
            SELECT s FROM generate_series(1, p_ceiling) s
             WHERE s <> ALL (ARRAY(SELECT a.global_slot FROM analysis_jobs a
                                    WHERE a.status IN ('pending', 'running')
                                      AND a.global_slot IS NOT NULL))
             ORDER BY s
             LIMIT least(greatest(p_ceiling - (SELECT count(*) FROM analysis_jobs a
                                               WHERE a.status IN ('pending', 'running')), 0),
                         coalesce(p_max, p_ceiling)));
    END IF;
    SELECT array_agg(p.id) FILTER (WHERE p.moves) AS ids,
           array_agg(p.status) FILTER (WHERE p.moves) AS statuses,
           array_agg(p.user_slot) FILTER (WHERE p.moves) AS uslots,
           array_agg(p.global_slot) FILTER (WHERE p.moves) AS gslots,
           array_agg(p.wait) FILTER (WHERE p.moves) AS waits,
           array_agg(p.turn) FILTER (WHERE p.moves) AS turns,
           coalesce(array_agg(p.status ORDER BY p.seq) FILTER (WHERE p.new), '{}') AS n_status,
           coalesce(array_agg(p.user_slot ORDER BY p.seq) FILTER (WHERE p.new), '{}') AS n_uslot,
           coalesce(array_agg(p.global_slot ORDER BY p.seq) FILTER (WHERE p.new), '{}') AS n_gslot,
           coalesce(array_agg(p.wait ORDER BY p.seq) FILTER (WHERE p.new), '{}') AS n_wait,
           coalesce(array_agg(p.turn ORDER BY p.seq) FILTER (WHERE p.new), '{}') AS n_turn,
           array_agg(DISTINCT p.user_id) FILTER (WHERE p.status = 'pending' AND NOT p.delta)
               AS starters,
           coalesce(bool_or(p.wait = 'provider_capacity' AND (p.new OR p.moves)), false)
               AS made_ready,
           count(*) FILTER (WHERE p.global_slot IS NOT NULL) AS given
      INTO m
      FROM aq_placements_v1(p_users, p_ceiling, v_slots, v_now,
                            p_new_ids, p_new_users, p_new_deltas) p;
    new_status := m.n_status;
    new_user_slot := m.n_uslot;
    new_global_slot := m.n_gslot;
    new_wait := m.n_wait;
    new_turn := m.n_turn;
    promoted := '{}';
    IF m.ids IS NOT NULL THEN
        WITH moved AS (
            UPDATE analysis_jobs j
               SET status = x.status, user_slot = x.uslot, global_slot = x.gslot,
                   waiting_for = x.wait, turn_key = x.turn, updated_at = v_now,
                   promoted_at = CASE WHEN x.status = 'pending' THEN v_now END
              FROM unnest(m.ids, m.statuses, m.uslots, m.gslots, m.waits, m.turns)
                   AS x(id, status, uslot, gslot, wait, turn)
             WHERE j.id = x.id AND j.status = 'queued'
            RETURNING j)
        SELECT coalesce(array_agg(d.j ORDER BY (d.j).user_id, (d.j).queue_seq)
                            FILTER (WHERE (d.j).status = 'pending'), '{}')
          INTO promoted FROM moved d;
    END IF;
    IF p_ceiling IS NOT NULL AND m.starters IS NOT NULL THEN
        INSERT INTO user_turns AS t (user_id, last_turn_at)
        SELECT u, v_now FROM unnest(m.starters) u ORDER BY u
        ON CONFLICT (user_id) DO UPDATE SET last_turn_at = EXCLUDED.last_turn_at;
    END IF;
    -- Capacity someone may wait for: a job this decision made ready while it gives out no
    -- slot (G shared) and a slot is free (a slot freed by a holder beside it is that holder's
    -- to ask for: its pass waits for this decision), or a slot left free while a user not
    -- locked here waits.
    asks_pass := p_ceiling IS NOT NULL AND (
        (NOT p_allocates AND m.made_ready
         AND (SELECT count(*) FROM analysis_jobs a
               WHERE a.status IN ('pending', 'running')) < p_ceiling)
        OR (p_allocates AND m.given < cardinality(v_slots) AND EXISTS (
                SELECT 1 FROM analysis_jobs q
                 WHERE q.status = 'queued' AND q.waiting_for = 'provider_capacity'
                   AND q.user_id <> ALL (p_users))));
END
$$;

-- Where a job stands in its user's queue: 1 for the next to start, NULL when it does not wait
-- there (pending, running, ended, or a delta, which never queues).
CREATE OR REPLACE FUNCTION aq_queue_position_v1(p_job analysis_jobs)
RETURNS bigint LANGUAGE plpgsql STABLE AS $$
BEGIN
    -- PL/pgSQL, so the count's plan is kept for the session (called per admitted click).
    IF p_job.status IS DISTINCT FROM 'queued' OR NOT aq_first_pass_v1(p_job.delta_of_job_id) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT count(*) FROM analysis_jobs q
             WHERE q.user_id = p_job.user_id AND q.status = 'queued'
               AND aq_first_pass_v1(q.delta_of_job_id)
               AND q.queue_seq <= p_job.queue_seq);
END
$$;
