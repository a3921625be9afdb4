-- finish: end jobs (Core's completions, a failed release, a lost run, a cancel) and fill the
-- slots they free, in one transaction under the decision's locks (docs/locking.md).
--
-- Idempotent by construction: the move is a compare-and-set from the statuses in p_from, so a
-- duplicate, late or out-of-order report changes nothing twice. The refund rule is credits.sql.

-- The decision's locks held. Move jobs to a terminal status and/or soft-delete them, each by a
-- compare-and-set, in item order, and refund what never reached judging (credits.sql); fills
-- nothing (aq_finish_v3 does). Each item names its job by job_id or core_run_id
-- (user_id, when given, scopes it to that user); status NULL means "only soft-delete"; the move
-- happens only from a status in "from"; ran: Core judged the run, so it started even if running
-- was never written (a fast callback can beat the releasing instance's update). The jobs are
-- row-locked in id order first, which pins their status against writers that take no user lock
-- (claims); then what each item does is decided (aq_end_decisions_v1) and one UPDATE writes
-- every change. Returns, per item: the job after the call (NULL: no such
-- job), its status before, whether the item changed it, whether it refunded.
-- p_items: [{"item": n, "job_id" | "core_run_id", "user_id", "status", "from", "delete",
-- "error_code", "error_detail", "verdicts", "ran"}, ...].
CREATE OR REPLACE FUNCTION aq_end_jobs_locked_v1(p_items jsonb)
RETURNS TABLE (item integer, job analysis_jobs, old_status text, changed boolean,
               refunded boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_jobs analysis_jobs[];
    v_ids uuid[];
    v_job analysis_jobs;
    d record;
BEGIN
    SELECT array_agg(l.j ORDER BY (l.j).id) INTO v_jobs FROM (
        SELECT j FROM analysis_jobs j
         WHERE j.id = ANY (ARRAY(SELECT x.job_id FROM jsonb_to_recordset(p_items) AS x(job_id uuid)
                                  WHERE x.job_id IS NOT NULL))
            OR j.core_run_id = ANY (ARRAY(SELECT x.core_run_id
                                            FROM jsonb_to_recordset(p_items) AS x(core_run_id text)
                                           WHERE x.core_run_id IS NOT NULL))
         ORDER BY j.id
           FOR UPDATE OF j) l;
    d := aq_end_decisions_v1(p_items, v_jobs);
    -- One UPDATE writes every change: the table's statement costs (indexes, CHECKs, the change
    -- trigger) are paid once per batch. A move clears the job's queue and claim state.
    IF cardinality(d.w_id) > 0 THEN
        v_ids := ARRAY(SELECT x.id FROM unnest(v_jobs) x);
        FOR v_job IN
            UPDATE analysis_jobs j
               SET status = CASE WHEN w.move THEN w.status ELSE j.status END,
                   finished_at = CASE WHEN w.move THEN clock_timestamp() ELSE j.finished_at END,
                   started_at = CASE WHEN w.move AND w.ran
                                     THEN coalesce(j.started_at, clock_timestamp())
                                     ELSE j.started_at END,
                   updated_at = clock_timestamp(),
                   deleted_at = CASE WHEN w.del THEN clock_timestamp() ELSE j.deleted_at END,
                   error_code = CASE WHEN w.move THEN w.code ELSE j.error_code END,
                   error_detail = CASE WHEN w.move THEN w.detail ELSE j.error_detail END,
                   verdicts = CASE WHEN w.move THEN coalesce(w.verdicts, j.verdicts)
                                   ELSE j.verdicts END,
                   waiting_for = CASE WHEN w.move THEN NULL ELSE j.waiting_for END,
                   turn_key = CASE WHEN w.move THEN NULL ELSE j.turn_key END,
                   claimed_by = CASE WHEN w.move THEN NULL ELSE j.claimed_by END,
                   claim_expires_at = CASE WHEN w.move THEN NULL ELSE j.claim_expires_at END,
                   next_release_at = CASE WHEN w.move THEN NULL ELSE j.next_release_at END
              FROM unnest(d.w_id, d.w_move, d.w_status, d.w_delete, d.w_code, d.w_detail,
                          d.w_verdicts, d.w_ran)
                   AS w(id, move, status, del, code, detail, verdicts, ran)
             WHERE j.id = w.id
            RETURNING j.*
        LOOP
            v_jobs[array_position(v_ids, v_job.id)] := v_job;
        END LOOP;
    END IF;
    FOR i IN 1 .. cardinality(d.items) LOOP
        item := d.items[i];
        job := v_jobs[d.ks[i]];
        old_status := d.olds[i];
        changed := d.changes[i];
        refunded := false;
        IF d.moves[i] THEN  -- a soft delete alone refunds nothing
            refunded := aq_refund_if_due_v1(job, old_status);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;

-- What each item of p_items (as aq_end_jobs_locked_v1 takes them) does to p_jobs (locked, in
-- id order), in item order: a job changes once per call, so a later item about it sees the
-- status the earlier one wrote and changes nothing. Per item: the index of its job in p_jobs
-- (ks; NULL: none, or another user's), its status before, whether the item changes it and
-- whether it moves its status; and the writes, one per job changed (w_*).
CREATE OR REPLACE FUNCTION aq_end_decisions_v1(
    p_items jsonb, p_jobs analysis_jobs[],
    OUT items integer[], OUT ks integer[], OUT olds text[], OUT changes boolean[],
    OUT moves boolean[], OUT w_id uuid[], OUT w_move boolean[], OUT w_status text[],
    OUT w_delete boolean[], OUT w_code text[], OUT w_detail text[], OUT w_verdicts jsonb[],
    OUT w_ran boolean[])
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    r record;
    v_ids uuid[] := ARRAY(SELECT x.id FROM unnest(p_jobs) x);
    v_runs text[] := ARRAY(SELECT x.core_run_id FROM unnest(p_jobs) x);
    v_status text[] := ARRAY(SELECT x.status FROM unnest(p_jobs) x);
    v_moved uuid[] := '{}';
    k integer;
    j analysis_jobs;
BEGIN
    items := '{}'; ks := '{}'; olds := '{}'; changes := '{}'; moves := '{}'; w_id := '{}';
    w_move := '{}'; w_status := '{}'; w_delete := '{}'; w_code := '{}'; w_detail := '{}';
    w_verdicts := '{}'; w_ran := '{}';
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, job_id uuid, core_run_id text, user_id text, status text,
            "from" text[], delete boolean, error_code text, error_detail text, verdicts jsonb,
            ran boolean)
        ORDER BY x.item
    LOOP
        k := coalesce(array_position(v_ids, r.job_id), array_position(v_runs, r.core_run_id));
        j := p_jobs[k];
        IF r.user_id IS NOT NULL AND j.user_id <> r.user_id THEN
            k := NULL;
            j := NULL;
        END IF;
        items := items || r.item;
        ks := ks || k;
        olds := olds || v_status[k];
        IF k IS NULL OR j.id = ANY (v_moved) THEN
            changes := changes || false;
            moves := moves || false;
        ELSIF r.status IS NOT NULL AND v_status[k] = ANY (r."from") THEN
            moves := moves || true;
            w_status := w_status || r.status;
            w_delete := w_delete || coalesce(r.delete, false);
            v_status[k] := r.status;
        ELSIF coalesce(r.delete, false) AND j.deleted_at IS NULL
              AND v_status[k] IN ('succeeded', 'failed', 'cancelled') THEN
            moves := moves || false;
            w_status := w_status || NULL::text;
            w_delete := w_delete || true;
        ELSE
            changes := changes || false;
            moves := moves || false;
        END IF;
        IF cardinality(changes) < cardinality(items) THEN  -- the item changes its job
            changes := changes || true;
            w_move := w_move || moves[cardinality(moves)];
            v_moved := v_moved || j.id;
            w_id := w_id || j.id;
            w_code := w_code || r.error_code;
            w_detail := w_detail || r.error_detail;
            w_verdicts := w_verdicts || r.verdicts;
            w_ran := w_ran || coalesce(r.ran, false);
        END IF;
    END LOOP;
END
$$;

-- The locks of p_users held, under G shared with the ceiling on (not p_allocates): which of
-- the global slots p_freed, freed by this decision's completions, it gives out (no other
-- decision can give these numbers out; at most what the ceiling leaves room for), and the
-- users to place them among: p_users and the next in turn whose locks are free
-- (aq_next_in_turn_v1, only tried; docs/locking.md). short: room these completions made is
-- left that their numbers do not fill (a number above a lowered ceiling, or a job that held
-- none), for a pass; room that was free before is whoever left it's to ask for.
-- Otherwise (ceiling off, G exclusive, nothing freed): slots NULL, users p_users.
CREATE OR REPLACE FUNCTION aq_hand_on_locked_v1(
    p_freed integer[], p_ceiling integer, p_allocates boolean, p_users text[],
    OUT slots integer[], OUT users text[], OUT short boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_room integer;
BEGIN
    users := p_users;
    short := false;
    IF p_ceiling IS NULL OR p_allocates OR cardinality(p_freed) = 0 THEN
        RETURN;
    END IF;
    v_room := p_ceiling - (SELECT count(*) FROM analysis_jobs a
                            WHERE a.status IN ('pending', 'running'));
    slots := ARRAY(SELECT f FROM unnest(p_freed) f
                    WHERE f <= p_ceiling ORDER BY f LIMIT greatest(v_room, 0));
    users := ARRAY(SELECT DISTINCT u FROM unnest(
                       p_users || aq_next_in_turn_v1(cardinality(slots), p_users, true)) u
                    ORDER BY u);
    short := cardinality(slots) < least(greatest(v_room, 0), cardinality(p_freed));
END
$$;

-- Finish a batch of jobs under the decision's locks (aq_lock_decision_v2) and fill what they
-- free with the one placement (aq_place_locked_v2, slots.sql): the users' next jobs. With the
-- ceiling on it holds G shared, as most decisions do, and hands the global slots it freed to
-- whoever's turn it is, if it can take their user's lock without waiting; what it cannot give
-- it asks a pass (G exclusive) to (docs/locking.md). A report about a job that this placement
-- just started (Core ended its held run before the release) is then applied in
-- a round of its own, as it would have been after the report that freed the slot. The jobs
-- started are claimed for p_instance, which releases them. One row per item: outcome
-- 'finished' or 'unknown' (no such job), the job after the call, its status before, whether
-- the item changed it, whether it refunded; what a round started goes with the first item of
-- that round that changed a job of the same user, others' with its first item that changed
-- any (aq_given_to_v1); asks_pass with the first item.
-- p_items: as aq_end_jobs_locked_v1 takes them (a lone cancel is a batch of one).
CREATE OR REPLACE FUNCTION aq_finish_v3(
    p_items jsonb, p_instance text, p_lease_s double precision)
RETURNS TABLE (item integer, outcome text, job analysis_jobs, old_status text, changed boolean,
               refunded boolean, promoted analysis_jobs[], asks_pass boolean)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_lock record;
    v_place record;
    v_ids uuid[];
    v_todo jsonb := p_items;
    v_ask boolean := false;
    v_users text[];
    v_freed integer[];  -- the global slots a round freed
    v_hand record;
    v_round integer := 0;
    -- The ends, one per item (the round that last applied it); the jobs started, by round.
    e_item integer[] := '{}';
    e_job analysis_jobs[] := '{}';
    e_old text[] := '{}';
    e_changed boolean[] := '{}';
    e_refunded boolean[] := '{}';
    e_round integer[] := '{}';
    s_job analysis_jobs[] := '{}';
    s_round integer[] := '{}';
    s_to integer[];  -- the end each started job goes with (aq_given_to_v1)
    e record;
    k integer;
BEGIN
    -- The items' jobs, each by one index probe, read before any lock: who to lock.
    v_ids := ARRAY(
        SELECT coalesce(
                   (SELECT j.id FROM analysis_jobs j WHERE j.id = x.job_id),
                   (SELECT j.id FROM analysis_jobs j WHERE j.core_run_id = x.core_run_id))
          FROM jsonb_to_recordset(p_items) AS x(job_id uuid, core_run_id text));
    SELECT * INTO v_lock FROM aq_lock_decision_v2(
        ARRAY(SELECT j.user_id FROM analysis_jobs j WHERE j.id = ANY (v_ids)), false);
    v_users := v_lock.users;
    WHILE v_todo IS NOT NULL LOOP
        v_round := v_round + 1;
        v_freed := '{}';
        FOR e IN SELECT * FROM aq_end_jobs_locked_v1(v_todo) LOOP
            k := coalesce(array_position(e_item, e.item), cardinality(e_item) + 1);
            e_item[k] := e.item;  -- a later round's answer replaces the item's earlier one
            e_job[k] := e.job;
            e_old[k] := e.old_status;
            e_changed[k] := e.changed;
            e_refunded[k] := e.refunded;
            e_round[k] := v_round;
            IF e.changed AND e.old_status IN ('pending', 'running') THEN
                v_freed := v_freed || (e.job).global_slot;
            END IF;
        END LOOP;
        SELECT * INTO v_hand FROM aq_hand_on_locked_v1(
            v_freed, v_lock.ceiling, v_lock.allocates, v_users);
        v_users := v_hand.users;
        SELECT * INTO v_place FROM aq_place_locked_v2(
            v_users, v_lock.ceiling, v_lock.allocates OR v_hand.slots IS NOT NULL, NULL,
            v_hand.slots, '{}', '{}', '{}');
        s_job := s_job || v_place.promoted;
        s_round := s_round || array_fill(v_round, ARRAY[cardinality(v_place.promoted)]);
        v_ask := v_ask OR v_hand.short OR v_place.asks_pass;
        -- The items that found their job still queued, now started by this placement.
        v_todo := (SELECT jsonb_agg(t.e) FROM jsonb_array_elements(v_todo) t(e)
                    WHERE EXISTS (SELECT 1 FROM unnest(v_place.promoted) p
                                   WHERE p.id::text = t.e ->> 'job_id'
                                      OR p.core_run_id = t.e ->> 'core_run_id'));
    END LOOP;
    s_job := aq_claim_started_v1(s_job, p_instance, p_lease_s);
    s_to := ARRAY(SELECT aq_given_to_v1(e_item, e_job, e_changed, e_round, s_round[j],
                                        (s_job[j]).user_id)
                    FROM generate_subscripts(s_job, 1) j ORDER BY j);
    FOR k IN SELECT i FROM generate_subscripts(e_item, 1) i ORDER BY e_item[i] LOOP
        item := e_item[k];
        job := e_job[k];
        outcome := CASE WHEN job.id IS NULL THEN 'unknown' ELSE 'finished' END;
        old_status := e_old[k];
        changed := e_changed[k];
        refunded := e_refunded[k];
        promoted := ARRAY(SELECT s_job[j] FROM generate_subscripts(s_job, 1) j
                           WHERE s_to[j] = k ORDER BY j);
        asks_pass := v_ask AND item = (SELECT min(i) FROM unnest(e_item) i);
        RETURN NEXT;
    END LOOP;
END
$$;

-- Which end of aq_finish_v3 a job started in round p_round goes with (its index): the first
-- item of that round, in item order, that changed a job of p_user's; else the round's first
-- item that changed any.
CREATE OR REPLACE FUNCTION aq_given_to_v1(
    p_items integer[], p_jobs analysis_jobs[], p_changed boolean[], p_rounds integer[],
    p_round integer, p_user text)
RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT i FROM generate_subscripts(p_items, 1) i
     WHERE p_rounds[i] = p_round AND p_changed[i]
     ORDER BY (p_jobs[i]).user_id IS DISTINCT FROM p_user, p_items[i]
     LIMIT 1
$$;
