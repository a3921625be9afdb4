-- finish: end a job (Core's completion, a failed release, a lost run, a cancel) and fill the
-- slot it frees, in one transaction under the user's lock (docs/locking.md).
--
-- Idempotent by construction: the move is a compare-and-set from the statuses in p_from, so a
-- duplicate, late or out-of-order report changes nothing twice. The refund rule is credits.sql.

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
    -- The row lock pins old_status against writers that do not take the user lock (claims).
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
        refunded := aq_refund_if_due_v1(job, old_status);
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
-- batch is being written, finished in one transaction, each by aq_finish_v2 above, in order,
-- each filling the slot its job frees. As with admits (admit.sql), a report whose user's lock
-- another transaction holds for longer than a moment (aq_lock_users_v1) comes back 'busy'
-- (and so does every later one of that user in the batch), and its caller finishes it alone.
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
    v_busy text[] := '{}';
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
    v_busy := aq_lock_users_v1(
        ARRAY(SELECT (SELECT j.user_id FROM analysis_jobs j WHERE j.core_run_id = x.core_run_id)
                FROM jsonb_to_recordset(p_items) AS x(core_run_id text)),
        aq_batch_lock_wait_ms_v1());
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
        SELECT j.user_id INTO v_user FROM analysis_jobs j WHERE j.core_run_id = r.core_run_id;
        IF NOT FOUND THEN
            outcome := 'unknown';
        ELSIF v_user = ANY (v_busy) THEN
            outcome := 'busy';
        ELSE
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
