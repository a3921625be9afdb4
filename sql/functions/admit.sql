-- admit: reserve a run id and hold the click's credit, then admit the job once Core holds its
-- run (queue/admit.py). One function each, for a batch of clicks: a lone click is a batch of
-- one (queue/group_commit.py gathers them).
--
-- Every check a click can fail is decided here or by Core, synchronously: the Idempotency-Key
-- and the credit at the reservation, before Core is asked for anything; the admit itself is
-- one INSERT whose status is the write-up's CASE (aq_placements_v1, slots.sql), under the
-- user's lock (docs/locking.md): a second click of the same user waits for the first to
-- commit and then sees its job.

-- What a click's Idempotency-Key already names, outside the click's own batch (aq_reserve_v2,
-- under the user's lock): its job (existing, or key_reused for another body), else a click in
-- flight (in_progress, or key_reused), else nothing (outcome NULL).
CREATE OR REPLACE FUNCTION aq_key_seen_v1(
    p_user text, p_key text, p_hash text, OUT outcome text, OUT job_id uuid)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    -- PL/pgSQL, not SQL: called per keyed click, it keeps its plan for the session (a SQL
    -- function here is planned again on every call, eight times the cost).
    SELECT k.outcome, k.job_id INTO outcome, job_id FROM (
        SELECT 1 AS rank, j.id AS job_id,
               CASE WHEN j.request_hash = p_hash THEN 'existing' ELSE 'key_reused' END AS outcome
          FROM analysis_jobs j WHERE j.user_id = p_user AND j.idempotency_key = p_key
        UNION ALL
        SELECT 2, NULL,
               CASE WHEN c.request_hash = p_hash THEN 'in_progress' ELSE 'key_reused' END
          FROM core_run_reservations c WHERE c.user_id = p_user AND c.idempotency_key = p_key
    ) k ORDER BY k.rank LIMIT 1;
END
$$;

-- Reserve run ids before Core is asked for held runs: per click, in item order, resolve its
-- Idempotency-Key, then hold its cost against the balance less every hold already made (the
-- user's reservations still in flight, this batch's included), so concurrent clicks of a user
-- see each other's holds and a click that cannot be paid for never reaches Core. The hold is
-- the reservation row's cost: the admit turns it into the debit; deleting the row (Core
-- refused, or the sweep reclaimed it) releases it, once.
-- A click whose run id is reserved already is answered reserved again, holding nothing more:
-- a call repeated after its connection died is safe (store/database.py, SAFE_TO_REPEAT).
-- p_items: [{"item", "user_id", "run_id", "job_id", "cost", "thesis", "sources",
-- "idempotency_key", "request_hash"}]. Outcomes: reserved | existing | in_progress |
-- key_reused | insufficient_credits; balance: what was left to hold, on a refusal.
CREATE OR REPLACE FUNCTION aq_reserve_v2(p_items jsonb)
RETURNS TABLE (item integer, outcome text, job_id uuid, balance bigint)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    r record;
    v_users text[];
    v_free bigint[];
    v_keys text[] := '{}';  -- user || E'\x1f' || key of the batch's reservations, and hashes
    v_hashes text[] := '{}';
    v_taken integer[] := '{}';
    d integer;
BEGIN
    -- A keyed click's check and reservation are atomic with the admit that turns it into a
    -- job: under its user's lock. The holds, under the users' hold locks.
    PERFORM aq_lock_users_v1(ARRAY(
        SELECT x.user_id FROM jsonb_to_recordset(p_items) x(user_id text, idempotency_key text)
         WHERE x.idempotency_key IS NOT NULL));
    PERFORM aq_lock_holds_v1(
        ARRAY(SELECT x.user_id FROM jsonb_to_recordset(p_items) x(user_id text)));
    SELECT array_agg(u.u ORDER BY u.u),
           array_agg(coalesce(a.balance, 0) - coalesce(
               (SELECT sum(c.cost) FROM core_run_reservations c WHERE c.user_id = u.u), 0)
               ORDER BY u.u)
      INTO v_users, v_free
      FROM (SELECT DISTINCT x.user_id AS u FROM jsonb_to_recordset(p_items) x(user_id text)) u
      LEFT JOIN credit_accounts a ON a.user_id = u.u;
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, user_id text, run_id uuid, job_id uuid, cost integer,
            idempotency_key text, request_hash text)
        ORDER BY x.item
    LOOP
        item := r.item;
        outcome := NULL;
        job_id := NULL;
        balance := NULL;
        IF EXISTS (SELECT 1 FROM core_run_reservations c WHERE c.run_id = r.run_id) THEN
            outcome := 'reserved';
            job_id := r.job_id;
        ELSIF r.idempotency_key IS NOT NULL THEN
            -- A key an earlier click of this batch reserved is in progress too.
            d := array_position(v_keys, r.user_id || E'\x1f' || r.idempotency_key);
            IF d IS NOT NULL THEN
                outcome := CASE WHEN v_hashes[d] = r.request_hash THEN 'in_progress'
                                ELSE 'key_reused' END;
            ELSE
                SELECT k.outcome, k.job_id INTO outcome, job_id
                  FROM aq_key_seen_v1(r.user_id, r.idempotency_key, r.request_hash) k;
            END IF;
        END IF;
        IF outcome IS NOT NULL THEN
            RETURN NEXT;
            CONTINUE;
        END IF;
        d := array_position(v_users, r.user_id);
        IF v_free[d] < r.cost THEN
            outcome := 'insufficient_credits';
            balance := greatest(v_free[d], 0);
            RETURN NEXT;
            CONTINUE;
        END IF;
        v_free[d] := v_free[d] - greatest(r.cost, 0);
        v_keys := v_keys || (r.user_id || E'\x1f' || coalesce(r.idempotency_key, ''));
        v_hashes := v_hashes || r.request_hash;
        v_taken := v_taken || r.item;
        outcome := 'reserved';
        job_id := r.job_id;
        RETURN NEXT;
    END LOOP;
    INSERT INTO core_run_reservations
        (run_id, job_id, user_id, thesis, sources, idempotency_key, request_hash, cost)
    SELECT x.run_id, x.job_id, x.user_id, x.thesis, x.sources, x.idempotency_key,
           x.request_hash, greatest(x.cost, 0)
      FROM jsonb_to_recordset(p_items) AS x(
               item integer, user_id text, run_id uuid, job_id uuid, cost integer,
               thesis jsonb, sources jsonb, idempotency_key text, request_hash text)
     WHERE x.item = ANY (v_taken)
     ORDER BY x.item;
END
$$;

-- Admit the clicks whose held runs Core made, under the decision's locks (aq_lock_decision_v2):
-- per click, in item order, its reservation must still be held ('reservation_gone': the sweep
-- reclaimed it; 'repeated', with its job, when this same call had committed and is sent again
-- after its connection died, store/database.py SAFE_TO_REPEAT) and its user's balance, less
-- what the earlier clicks debited, cover its cost ('insufficient_credits': a hold the previous
-- release did not make); then every admitted job
-- is placed at once (aq_place_locked_v2), and each table is written once for the batch. The
-- jobs that start (the admitted and any the placement promoted) are claimed for p_instance,
-- which releases them. One row per item; promoted (others' jobs) and asks_pass (capacity left
-- for a pass) ride on the first admitted row.
-- p_items: [{"item", "job_id", "user_id", "run_id", "core_run_id", "thesis", "sources",
-- "cost", "delta_of", "idempotency_key", "request_hash"}].
CREATE OR REPLACE FUNCTION aq_admit_v3(
    p_items jsonb, p_instance text, p_lease_s double precision)
RETURNS TABLE (item integer, outcome text, job analysis_jobs, queue_position bigint,
               promoted analysis_jobs[], asks_pass boolean)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_lock record;
    v_place record;
    v_checked record;
    v_jobs analysis_jobs[] := '{}';
    v_positions bigint[];
    v_first integer;
    v_item integer;
BEGIN
    SELECT * INTO v_lock FROM aq_lock_decision_v2(
        ARRAY(SELECT x.user_id FROM jsonb_to_recordset(p_items) x(user_id text)),
        aq_may_start_v1(p_items));
    SELECT * INTO v_checked FROM aq_admissible_locked_v1(p_items);
    SELECT * INTO v_place FROM aq_place_locked_v2(
        v_lock.users, v_lock.ceiling, v_lock.allocates, NULL, NULL,
        v_checked.ids, v_checked.users, v_checked.deltas);
    IF cardinality(v_checked.ids) > 0 THEN
        DELETE FROM core_run_reservations c WHERE c.run_id = ANY (v_checked.runs);
        UPDATE credit_accounts a
           SET balance = a.balance - d.total, updated_at = clock_timestamp()
          FROM (SELECT x.u, sum(x.c) AS total FROM unnest(v_checked.users, v_checked.costs) x(u, c)
                 WHERE x.c > 0 GROUP BY x.u) d
         WHERE a.user_id = d.u;
        -- In item order, so each job's queue_seq (its default, drawn row by row) follows it.
        WITH admitted AS (
            INSERT INTO analysis_jobs AS j
                (id, user_id, run_id, core_run_id, status, delta_of_job_id, thesis, sources,
                 cost, idempotency_key, request_hash, created_at, updated_at, promoted_at,
                 user_slot, global_slot, waiting_for, turn_key)
            SELECT x.job_id, x.user_id, x.run_id, x.core_run_id, p.status, x.delta_of, x.thesis,
                   x.sources, x.cost, x.idempotency_key, x.request_hash, clock_timestamp(),
                   clock_timestamp(), CASE WHEN p.status = 'pending' THEN clock_timestamp() END,
                   p.uslot, p.gslot, p.wait, p.turn
              FROM unnest(v_checked.ids, v_place.new_status, v_place.new_user_slot,
                          v_place.new_global_slot, v_place.new_wait, v_place.new_turn)
                       WITH ORDINALITY AS p(id, status, uslot, gslot, wait, turn, k)
              JOIN jsonb_to_recordset(p_items) AS x(
                       job_id uuid, user_id text, run_id uuid, core_run_id text, thesis jsonb,
                       sources jsonb, cost integer, delta_of uuid, idempotency_key text,
                       request_hash text) ON x.job_id = p.id
             ORDER BY p.k
            RETURNING j)
        SELECT array_agg(a.j ORDER BY array_position(v_checked.ids, (a.j).id)) INTO v_jobs
          FROM admitted a;
        INSERT INTO credit_ledger (user_id, job_id, kind, amount)
        SELECT x.u, x.id, 'debit', x.c FROM unnest(v_checked.users, v_checked.ids, v_checked.costs)
               AS x(u, id, c)
         WHERE x.c > 0;
        -- Counted under the locks, so each answer carries its true position.
        v_positions := ARRAY(
            SELECT aq_queue_position_v1(v_jobs[i]) FROM generate_subscripts(v_jobs, 1) i
             ORDER BY i);
        v_jobs := aq_claim_started_v1(v_jobs, p_instance, p_lease_s);
    END IF;
    v_place.promoted := aq_claim_started_v1(v_place.promoted, p_instance, p_lease_s);
    v_first := (SELECT min(i) FROM unnest(v_checked.items) i);
    FOR i IN 1 .. cardinality(v_checked.all_items) LOOP
        item := v_checked.all_items[i];
        outcome := v_checked.outcomes[i];
        job := v_jobs[array_position(v_checked.items, item)];
        queue_position := v_positions[array_position(v_checked.items, item)];
        IF outcome = 'repeated' THEN
            v_item := item;
            job := (SELECT j FROM jsonb_to_recordset(p_items) x(item integer, job_id uuid)
                      JOIN analysis_jobs j ON j.id = x.job_id WHERE x.item = v_item);
            queue_position := aq_queue_position_v1(job);
        END IF;
        promoted := CASE WHEN item = v_first THEN v_place.promoted ELSE '{}' END;
        asks_pass := item = v_first AND v_place.asks_pass;
        RETURN NEXT;
    END LOOP;
END
$$;

-- The decision's locks held: which clicks of p_items (as aq_admit_v3 takes them) may be
-- admitted, in item order. Their reservations are row-locked (the sweep's reclaim skips locked
-- rows), so each stays until the admit deletes it. Returns every item with its outcome, and
-- the admitted ones' items, job ids, users, run ids, costs and whether each is a delta.
CREATE OR REPLACE FUNCTION aq_admissible_locked_v1(
    p_items jsonb,
    OUT all_items integer[], OUT outcomes text[], OUT items integer[], OUT ids uuid[],
    OUT users text[], OUT runs uuid[], OUT costs integer[], OUT deltas boolean[])
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    v_held uuid[];
    v_users text[];
    v_balance bigint[];
    d integer;
BEGIN
    all_items := '{}'; outcomes := '{}'; items := '{}'; ids := '{}'; users := '{}';
    runs := '{}'; costs := '{}'; deltas := '{}';
    v_held := ARRAY(
        SELECT c.run_id FROM core_run_reservations c
         WHERE c.run_id = ANY (ARRAY(SELECT x.run_id
                                       FROM jsonb_to_recordset(p_items) x(run_id uuid)))
           FOR UPDATE);
    SELECT array_agg(u.u ORDER BY u.u), array_agg(coalesce(a.balance, 0) ORDER BY u.u)
      INTO v_users, v_balance
      FROM (SELECT DISTINCT x.user_id AS u FROM jsonb_to_recordset(p_items) x(user_id text)) u
      LEFT JOIN credit_accounts a ON a.user_id = u.u;
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, job_id uuid, user_id text, run_id uuid, cost integer, delta_of uuid)
        ORDER BY x.item
    LOOP
        all_items := all_items || r.item;
        d := array_position(v_users, r.user_id);
        IF NOT r.run_id = ANY (v_held) THEN
            -- Gone because this very admit committed (its answer lost with its connection):
            -- the call is being repeated, and the click is answered with its job.
            outcomes := outcomes || CASE
                WHEN EXISTS (SELECT 1 FROM analysis_jobs j
                              WHERE j.id = r.job_id AND j.run_id = r.run_id)
                THEN 'repeated' ELSE 'reservation_gone' END;
        ELSIF r.cost > 0 AND v_balance[d] < r.cost THEN
            outcomes := outcomes || 'insufficient_credits'::text;
        ELSE
            outcomes := outcomes || 'admitted'::text;
            v_held := array_remove(v_held, r.run_id);  -- a run is admitted once
            v_balance[d] := v_balance[d] - greatest(r.cost, 0);
            items := items || r.item;
            ids := ids || r.job_id;
            users := users || r.user_id;
            runs := runs || r.run_id;
            costs := costs || r.cost;
            deltas := deltas || NOT aq_first_pass_v1(r.delta_of);
        END IF;
    END LOOP;
END
$$;
