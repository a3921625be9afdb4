-- finish: end a job (Core's completion, a failed release, a lost run, a cancel) and fill the
-- slot it frees, in one transaction under the user's lock (docs/locking.md).
--
-- Idempotent by construction: the move is a compare-and-set from the statuses in p_from, so a
-- duplicate, late or out-of-order report changes nothing twice. The refund rule is credits.sql.

-- The users' locks held. Move jobs to a terminal status and/or soft-delete them, each by a
-- compare-and-set, in item order, and refund what never reached judging (credits.sql); fills
-- nothing (the callers do, by the ceiling). Each item names its job by job_id or core_run_id
-- (user_id, when given, scopes it to that user); status NULL means "only soft-delete"; the move
-- happens only from a status in "from"; ran: Core judged the run, so it started even if running
-- was never written (a fast callback can beat the releasing instance's update). A job changes
-- once per call: a later item about it sees the status the earlier one wrote and changes
-- nothing. The jobs are row-locked in id order first, which pins their status against writers
-- that take no user lock (claims); then one UPDATE writes every change, so the jobs table's
-- statement costs (indexes, CHECK constraints, the change trigger) are paid once per batch.
-- Returns, per item: the job after the call (NULL: no such job), its status before, whether the
-- item changed it, whether it refunded.
-- p_items: [{"item": n, "job_id" | "core_run_id", "user_id", "status", "from", "delete",
-- "error_code", "error_detail", "verdicts", "ran"}, ...].
CREATE OR REPLACE FUNCTION aq_end_jobs_locked_v1(p_items jsonb)
RETURNS TABLE (item integer, job analysis_jobs, old_status text, changed boolean,
               refunded boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    -- The items' jobs as locked, and what the items before decided for each.
    v_jobs analysis_jobs[];
    v_ids uuid[];
    v_runs text[];
    v_users text[];
    v_status text[];
    v_deleted boolean[];
    v_moved boolean[];
    k integer;
    -- Per item, in order.
    i_item integer[] := '{}';
    i_k integer[] := '{}';
    i_old text[] := '{}';
    i_changed boolean[] := '{}';
    i_move boolean[] := '{}';
    -- The writes, one per job changed: a move (with its columns) and/or a soft delete.
    w_id uuid[] := '{}';
    w_move boolean[] := '{}';
    w_status text[] := '{}';
    w_delete boolean[] := '{}';
    w_code text[] := '{}';
    w_detail text[] := '{}';
    w_verdicts jsonb[] := '{}';
    w_ran boolean[] := '{}';
    v_after analysis_jobs[];
    v_job analysis_jobs;
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
    SELECT array_agg(x.id ORDER BY x.ordinality), array_agg(x.core_run_id ORDER BY x.ordinality),
           array_agg(x.user_id ORDER BY x.ordinality), array_agg(x.status ORDER BY x.ordinality),
           array_agg(x.deleted_at IS NOT NULL ORDER BY x.ordinality),
           array_agg(false ORDER BY x.ordinality)
      INTO v_ids, v_runs, v_users, v_status, v_deleted, v_moved
      FROM unnest(v_jobs) WITH ORDINALITY AS x;

    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, job_id uuid, core_run_id text, user_id text, status text,
            "from" text[], delete boolean, error_code text, error_detail text, verdicts jsonb,
            ran boolean)
        ORDER BY x.item
    LOOP
        k := coalesce(array_position(v_ids, r.job_id), array_position(v_runs, r.core_run_id));
        IF r.user_id IS NOT NULL AND v_users[k] <> r.user_id THEN
            k := NULL;
        END IF;
        i_item := i_item || r.item;
        i_k := i_k || k;
        i_old := i_old || v_status[k];
        IF k IS NULL OR v_moved[k] THEN
            i_changed := i_changed || false;
            i_move := i_move || false;
            CONTINUE;
        END IF;
        IF r.status IS NOT NULL AND v_status[k] = ANY (r."from") THEN
            w_move := w_move || true;
            w_status := w_status || r.status;
            w_delete := w_delete || coalesce(r.delete, false);
            v_status[k] := r.status;
        ELSIF coalesce(r.delete, false) AND NOT v_deleted[k]
              AND v_status[k] IN ('succeeded', 'failed', 'cancelled') THEN
            w_move := w_move || false;
            w_status := w_status || NULL::text;
            w_delete := w_delete || true;
        ELSE
            i_changed := i_changed || false;
            i_move := i_move || false;
            CONTINUE;
        END IF;
        i_move := i_move || w_move[cardinality(w_move)];
        v_moved[k] := true;
        i_changed := i_changed || true;
        w_id := w_id || v_ids[k];
        w_code := w_code || r.error_code;
        w_detail := w_detail || r.error_detail;
        w_verdicts := w_verdicts || r.verdicts;
        w_ran := w_ran || coalesce(r.ran, false);
    END LOOP;

    IF cardinality(w_id) > 0 THEN
        WITH moved AS (
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
              FROM unnest(w_id, w_move, w_status, w_delete, w_code, w_detail, w_verdicts, w_ran)
                   AS w(id, move, status, del, code, detail, verdicts, ran)
             WHERE j.id = w.id
            RETURNING j)
        SELECT array_agg(m.j) INTO v_after FROM moved m;
        FOREACH v_job IN ARRAY v_after LOOP
            v_jobs[array_position(v_ids, v_job.id)] := v_job;
        END LOOP;
    END IF;

    FOR i IN 1 .. cardinality(i_item) LOOP
        item := i_item[i];
        job := v_jobs[i_k[i]];
        old_status := i_old[i];
        changed := i_changed[i];
        refunded := false;
        IF i_move[i] THEN  -- a soft delete alone refunds nothing
            refunded := aq_refund_if_due_v1(job, old_status);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;

-- Move a job to a terminal status (and/or soft-delete it) under its user's lock, refund what
-- never reached judging, and fill the slot it frees:
--   ceiling off: promote the user's next jobs in this transaction (tail promotion);
--   ceiling on:  re-derive the user's waits, and start the fairest ready job if it is this
--                user's, in the global slot the job frees (or, for a job that held none, if
--                the global lock is free); otherwise a promotion pass gives the slot to whoever's
--                turn it is.
--   p_job_id or p_core_run_id picks the job; p_user_id, when given, scopes it to that user.
--   p_status NULL means "only soft-delete"; the move happens only from a status in p_from.
--   p_ran: Core judged the run, so it started even if running was never written (a fast
--   callback can beat the releasing instance's update).
-- Returns the job after the call, its status before, whether the call changed it, whether it
-- refunded, and the jobs it moved from queued to pending.
CREATE OR REPLACE FUNCTION aq_finish_v2(
    p_job_id uuid, p_core_run_id text, p_user_id text,
    p_status text, p_from text[], p_delete boolean,
    p_error_code text, p_error_detail text, p_verdicts jsonb, p_ran boolean,
    OUT job analysis_jobs, OUT old_status text, OUT changed boolean, OUT refunded boolean,
    OUT promoted analysis_jobs[])
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_user text;
    v_id uuid;
    v_ceiling integer;
    v_started analysis_jobs;
    v_ended record;
BEGIN
    changed := false;
    refunded := false;
    promoted := '{}';
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

    v_ceiling := aq_ceiling_v2();
    IF v_ceiling IS NULL THEN
        -- Ceiling off: held shared until commit, so turning it on waits for this decision.
        PERFORM aq_lock_global_shared_v1();
        v_ceiling := aq_ceiling_v2();
    END IF;
    PERFORM aq_lock_user_v1(v_user);
    -- (A composite cannot be one of several INTO targets: through a record.)
    SELECT e.* INTO v_ended
      FROM aq_end_jobs_locked_v1(jsonb_build_array(jsonb_build_object(
               'item', 1, 'job_id', v_id, 'status', p_status, 'from', p_from,
               'delete', p_delete, 'error_code', p_error_code, 'error_detail', p_error_detail,
               'verdicts', p_verdicts, 'ran', p_ran))) e;
    job := v_ended.job;
    old_status := v_ended.old_status;
    changed := v_ended.changed;
    refunded := v_ended.refunded;

    IF NOT changed THEN
        RETURN;
    END IF;
    IF v_ceiling IS NULL THEN
        IF job.delta_of_job_id IS NULL THEN
            SELECT coalesce(array_agg(f), '{}') INTO promoted FROM aq_fill_user_locked_v1(v_user) f;
        END IF;
    ELSIF old_status IN ('queued', 'pending', 'running') THEN
        PERFORM aq_refresh_waits_locked_v1(v_user, v_ceiling);
        -- Starting the user's next job here needs the global lock, tried (shared to reuse the
        -- slot this frees, exclusive to allocate one: docs/locking.md), and the ceiling read
        -- again under it. When the try fails, a pass decides.
        IF old_status <> 'queued' AND job.global_slot IS NOT NULL THEN
            IF aq_try_lock_global_shared_v1() THEN
                v_ceiling := aq_ceiling_v2();
                IF v_ceiling IS NOT NULL THEN
                    v_started := aq_start_own_if_fairest_v1(v_user, v_ceiling, job.global_slot);
                END IF;
            END IF;
        ELSIF old_status <> 'queued' THEN
            IF aq_try_lock_global_v1() THEN
                v_ceiling := aq_ceiling_v2();
                IF v_ceiling IS NOT NULL THEN
                    v_started := aq_start_own_if_fairest_v1(v_user, v_ceiling);
                END IF;
            END IF;
        END IF;
        IF v_started.id IS NOT NULL THEN
            promoted := ARRAY[v_started];
        END IF;
    END IF;
END
$$;

-- Group commit of completions (queue/finish.py): Core's reports that arrive while the previous
-- batch is being written, finished in one transaction, in order. As with admits (admit.sql), a
-- report whose user's lock another transaction holds for longer than a moment
-- (aq_lock_users_v1) comes back 'busy' (and so does every later one of that user in the batch),
-- and its caller finishes it alone. With the ceiling off, every other report is ended at once
-- (aq_end_jobs_locked_v1) and then the slots they freed are filled at once
-- (aq_fill_users_locked_v1): a user's promoted jobs go with the first of their reports that
-- freed a slot. A report about a job that this fill just started (Core ended its held run before
-- the release) is then finished by itself, as it would have been after the report that freed
-- the slot. With the ceiling on, each report is finished by aq_finish_v2, in order.
-- p_items: [{"item": n, "core_run_id", "status", "from" (statuses), "error_code",
-- "error_detail", "verdicts", "ran"}, ...].
-- Outcomes: 'finished' (the columns of aq_finish_v2), 'unknown' (no such run), 'busy'. The
-- jobs the finishes promoted are claimed for p_instance, which releases them, all in one
-- statement once every report is finished (aq_claim_started_v1), and the rows come back after.
CREATE OR REPLACE FUNCTION aq_finish_many_v1(
    p_items jsonb, p_instance text, p_lease_s double precision)
RETURNS TABLE (item integer, outcome text, job analysis_jobs, old_status text, changed boolean,
               refunded boolean, promoted analysis_jobs[])
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    r record;
    v_finished record;
    v_user text;
    v_item_users text[];
    v_item_ids integer[];
    v_fill text[];
    v_busy text[] := '{}';
    v_ceiling integer;
    -- With the ceiling off: the ends, by item, and the jobs the fill started, by user.
    e_item integer[];
    e_job analysis_jobs[];
    e_old text[];
    e_changed boolean[];
    e_refunded boolean[];
    v_filled analysis_jobs[] := '{}';
    v_given text[] := '{}';
    v_p analysis_jobs;
    k integer;
    -- The answers, one per report, held until the claim.
    v_item integer[] := '{}';
    v_outcome text[] := '{}';
    v_job analysis_jobs[] := '{}';
    v_old text[] := '{}';
    v_changed boolean[] := '{}';
    v_refunded boolean[] := '{}';
    -- The jobs the batch promoted, in answer order; each answer's range in it: v_from .. v_to.
    v_started analysis_jobs[] := '{}';
    v_from integer[] := '{}';
    v_to integer[] := '{}';
    n integer := 0;
BEGIN
    PERFORM aq_lock_global_shared_v1();  -- as every finish with the ceiling off: before users
    -- Each report's user by its run, one index probe each (NULL for a run nobody has, which
    -- aq_lock_users_v1 skips): as a join, the planner hashed the whole jobs table whenever it
    -- judged it small, a seq scan per batch.
    v_item_users := ARRAY(
        SELECT (SELECT j.user_id FROM analysis_jobs j WHERE j.core_run_id = x.core_run_id)
          FROM jsonb_to_recordset(p_items) AS x(item integer, core_run_id text)
         ORDER BY x.item);
    v_item_ids := ARRAY(SELECT x.item FROM jsonb_to_recordset(p_items) AS x(item integer)
                         ORDER BY x.item);
    v_busy := aq_lock_users_v1(v_item_users, aq_batch_lock_wait_ms_v1());
    -- Read under the global lock held shared: it cannot change before this commits.
    v_ceiling := aq_ceiling_v2();
    IF v_ceiling IS NULL THEN
        SELECT array_agg(e.item ORDER BY e.item), array_agg(e.job ORDER BY e.item),
               array_agg(e.old_status ORDER BY e.item), array_agg(e.changed ORDER BY e.item),
               array_agg(e.refunded ORDER BY e.item)
          INTO e_item, e_job, e_old, e_changed, e_refunded
          FROM aq_end_jobs_locked_v1(
                   (SELECT coalesce(jsonb_agg(x.e), '[]')
                      FROM jsonb_array_elements(p_items) AS x(e)
                      CROSS JOIN LATERAL (
                            SELECT v_item_users[array_position(v_item_ids, (x.e ->> 'item')::integer)]
                                   AS u) w
                     WHERE w.u IS NOT NULL AND NOT w.u = ANY (v_busy))) e;
        -- The users of first-pass jobs that left a slot.
        v_fill := ARRAY(SELECT DISTINCT (e_job[i]).user_id FROM generate_subscripts(e_job, 1) i
                         WHERE e_changed[i] AND (e_job[i]).delta_of_job_id IS NULL);
        IF cardinality(v_fill) > 0 THEN
            v_filled := ARRAY(SELECT f FROM aq_fill_users_locked_v1(v_fill) f);
        END IF;
    END IF;
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, core_run_id text, status text, "from" text[], error_code text,
            error_detail text, verdicts jsonb, ran boolean)
        ORDER BY x.item
    LOOP
        n := n + 1;
        job := NULL;
        old_status := NULL;
        changed := false;
        refunded := false;
        v_from := v_from || (cardinality(v_started) + 1);
        v_user := v_item_users[n];
        k := array_position(e_item, r.item);
        IF v_user IS NULL THEN
            outcome := 'unknown';
        ELSIF v_user = ANY (v_busy) THEN
            outcome := 'busy';
        ELSIF k IS NOT NULL AND NOT (e_changed[k] = false
                                     AND (e_job[k]).id = ANY (ARRAY(SELECT f.id
                                                                     FROM unnest(v_filled) f))) THEN
            job := e_job[k];
            old_status := e_old[k];
            changed := e_changed[k];
            refunded := e_refunded[k];
            IF changed AND job.delta_of_job_id IS NULL AND NOT job.user_id = ANY (v_given) THEN
                v_given := v_given || job.user_id;
                FOREACH v_p IN ARRAY v_filled LOOP
                    IF v_p.user_id = job.user_id THEN
                        v_started := array_append(v_started, v_p);
                    END IF;
                END LOOP;
            END IF;
            outcome := CASE WHEN job.id IS NULL THEN 'unknown' ELSE 'finished' END;
        ELSE
            -- Ceiling on; or a report about a job the fill above just started.
            SELECT f.* INTO v_finished
              FROM aq_finish_v2(NULL, r.core_run_id, NULL, r.status, r."from", false,
                                r.error_code, r.error_detail, r.verdicts, r.ran) f;
            job := v_finished.job;
            old_status := v_finished.old_status;
            changed := v_finished.changed;
            refunded := v_finished.refunded;
            v_started := v_started || coalesce(v_finished.promoted, '{}');
            outcome := CASE WHEN job.id IS NULL THEN 'unknown' ELSE 'finished' END;
        END IF;
        v_to := v_to || cardinality(v_started);
        v_item := v_item || r.item;
        v_outcome := v_outcome || outcome;
        v_job := array_append(v_job, job);
        v_old := v_old || old_status;
        v_changed := v_changed || changed;
        v_refunded := v_refunded || refunded;
    END LOOP;
    -- One claim for the whole batch (PostgreSQL prepares the table's CHECK constraints once
    -- per writing statement), returned in the order given, claimed or as they were.
    v_started := aq_claim_started_v1(v_started, p_instance, p_lease_s);
    FOR i IN 1 .. n LOOP
        item := v_item[i];
        outcome := v_outcome[i];
        job := v_job[i];
        old_status := v_old[i];
        changed := v_changed[i];
        refunded := v_refunded[i];
        promoted := coalesce(v_started[v_from[i] : v_to[i]], '{}');
        RETURN NEXT;
    END LOOP;
END
$$;
