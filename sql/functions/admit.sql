-- admit: reserve a run id, then admit the job once Core holds its run (queue/admit.py).
--
-- Every check a click can fail is decided here or by Core, synchronously: the Idempotency-Key,
-- the balance, and the debit. The admit itself is one INSERT whose status is the write-up's
-- CASE, decided under the user's lock (docs/locking.md): a second click of the same user
-- waits for the first to commit and then sees its job.

-- Reserve a run id before Core is asked for a held run; check the balance; resolve an
-- Idempotency-Key. Outcomes: reserved | existing | in_progress | key_reused | insufficient_credits.
CREATE OR REPLACE FUNCTION aq_reserve_v1(
    p_user_id text, p_run_id uuid, p_job_id uuid, p_cost integer,
    p_thesis jsonb, p_sources jsonb, p_idempotency_key text, p_request_hash text,
    OUT outcome text, OUT job_id uuid, OUT balance bigint)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_hash text;
BEGIN
    job_id := p_job_id;
    IF p_idempotency_key IS NOT NULL THEN
        -- Under the lock the key check and the reservation are atomic with the admit that
        -- turns a reservation into a job.
        PERFORM aq_lock_user_v1(p_user_id);
        SELECT j.id, j.request_hash INTO job_id, v_hash
          FROM analysis_jobs j
         WHERE j.user_id = p_user_id AND j.idempotency_key = p_idempotency_key;
        IF FOUND THEN
            outcome := CASE WHEN v_hash = p_request_hash THEN 'existing' ELSE 'key_reused' END;
            RETURN;
        END IF;
        SELECT r.request_hash INTO v_hash
          FROM core_run_reservations r
         WHERE r.user_id = p_user_id AND r.idempotency_key = p_idempotency_key;
        IF FOUND THEN
            outcome := CASE WHEN v_hash = p_request_hash THEN 'in_progress' ELSE 'key_reused' END;
            job_id := NULL;
            RETURN;
        END IF;
    END IF;

    SELECT a.balance INTO balance FROM credit_accounts a WHERE a.user_id = p_user_id;
    balance := coalesce(balance, 0);
    IF balance < p_cost THEN
        outcome := 'insufficient_credits';
        job_id := NULL;
        RETURN;
    END IF;

    INSERT INTO core_run_reservations
        (run_id, job_id, user_id, thesis, sources, idempotency_key, request_hash)
    VALUES
        (p_run_id, p_job_id, p_user_id, p_thesis, p_sources, p_idempotency_key, p_request_hash);
    outcome := 'reserved';
END
$$;

-- Admit: under the user's lock, debit and insert the job whose status is the write-up's CASE,
-- with the user's limit and the provider ceiling:
--   ceiling off: a delta is pending; a first-pass job is pending when nothing of the user's
--     waits and a user slot is free, else queued for your_previous_analysis.
--   ceiling on:  the job is queued; its wait is derived like every other; if the global lock
--     is free (tried, never waited for) and the job's user is the fairest, a job of theirs
--     starts at once (this one, or an older one of theirs that waited for capacity).
-- Raises AQ402 (insufficient credits) or AQ410 (the reservation was reclaimed by the sweep);
-- either rolls the whole admit back. Returns the job, its queue position when queued, and the
-- jobs this admit moved from queued to pending (its followers release them).
CREATE OR REPLACE FUNCTION aq_admit_v2(
    p_job_id uuid, p_user_id text, p_run_id uuid, p_core_run_id text,
    p_thesis jsonb, p_sources jsonb, p_cost integer, p_delta_of uuid,
    p_idempotency_key text, p_request_hash text,
    OUT job analysis_jobs, OUT queue_position bigint, OUT promoted analysis_jobs[])
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    v_ceiling integer;
    v_now timestamptz;
    v_status text := 'queued';
    v_slot integer;
    v_wait text;
    v_turn timestamptz;
    v_room integer;
    v_started analysis_jobs;
BEGIN
    promoted := '{}';
    v_ceiling := aq_ceiling_v2();
    IF v_ceiling IS NULL THEN
        -- Ceiling off: held shared until commit, so turning it on waits for this decision.
        PERFORM aq_lock_global_shared_v1();
        v_ceiling := aq_ceiling_v2();
    END IF;
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
    -- holds the global lock to commit. The ceiling read above may have changed since (it was
    -- read without the lock when on): holding the global lock, read it again. Turned off
    -- meanwhile: fill as "off" does.
    IF v_wait = 'provider_capacity' THEN
        IF aq_try_lock_global_v1() THEN
            v_ceiling := aq_ceiling_v2();
            IF v_ceiling IS NULL THEN
                SELECT coalesce(array_agg(f), '{}') INTO promoted
                  FROM aq_fill_user_locked_v1(p_user_id) f;
            ELSE
                v_started := aq_start_own_if_fairest_v1(p_user_id, v_ceiling);
                IF v_started.id IS NOT NULL THEN
                    promoted := ARRAY[v_started];
                END IF;
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

-- Group commits (queue/admit.py): the reservations, and the admits, of the clicks that arrive
-- while the previous batch is being written, in one transaction each. Every click is decided
-- for itself, in arrival order, by the single-click function above. A click whose user's lock
-- another transaction holds comes back 'busy' (and so does every later click of that user in
-- the batch, so a user's clicks never overtake each other) and its caller decides it alone:
-- the reservations only try users' locks; the admits, which notify, wait for them a moment
-- (aq_lock_users_v1), since a click decided alone costs a notifying commit of its own. One
-- user's lock holder delays another user's click by that moment at most (docs/locking.md).
--
-- p_items: [{"item": n, ...the single-click function's arguments by name}, ...].

-- Outcomes: those of aq_reserve_v1, or 'busy'.
CREATE OR REPLACE FUNCTION aq_reserve_many_v1(p_items jsonb)
RETURNS TABLE (item integer, outcome text, job_id uuid, balance bigint)
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    r record;
    v_busy text[] := '{}';
BEGIN
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, user_id text, run_id uuid, job_id uuid, cost integer, thesis jsonb,
            sources jsonb, idempotency_key text, request_hash text)
        ORDER BY x.item
    LOOP
        item := r.item;
        -- Only a keyed click takes its user's lock (aq_reserve_v1).
        IF r.idempotency_key IS NOT NULL
           AND (r.user_id = ANY (v_busy) OR NOT aq_try_lock_user_v1(r.user_id)) THEN
            v_busy := v_busy || r.user_id;
            outcome := 'busy';
            job_id := NULL;
            balance := NULL;
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT v.outcome, v.job_id, v.balance INTO outcome, job_id, balance
          FROM aq_reserve_v1(r.user_id, r.run_id, r.job_id, r.cost, r.thesis, r.sources,
                             r.idempotency_key, r.request_hash) v;
        RETURN NEXT;
    END LOOP;
END
$$;

-- The run's reservation, row-locked (the sweep's reclaim skips locked rows), or false when the
-- sweep reclaimed it: checked before the admit so that its refusal rolls back nothing.
CREATE OR REPLACE FUNCTION aq_reservation_held_v1(p_run_id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM core_run_reservations c WHERE c.run_id = p_run_id FOR UPDATE;
    RETURN FOUND;
END
$$;

-- Outcomes: 'admitted' (job, queue_position, promoted as aq_admit_v2 returns them),
-- 'insufficient_credits', 'reservation_gone' (the refusals aq_admit_v2 raises, decided here
-- before anything is written, so they roll back nothing of the batch), or 'busy'. The jobs the
-- admits started are claimed for p_instance, which releases them, all in one statement once
-- every click is decided (aq_claim_started_v1), and the rows come back after it.
CREATE OR REPLACE FUNCTION aq_admit_many_v1(
    p_items jsonb, p_instance text, p_lease_s double precision)
RETURNS TABLE (item integer, outcome text, job analysis_jobs, queue_position bigint,
               promoted analysis_jobs[])
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' AS $$
DECLARE
    r record;
    v_admitted record;
    v_busy text[] := '{}';
    -- The answers, one per click, held until the claim: item, outcome, job, position.
    v_item integer[] := '{}';
    v_outcome text[] := '{}';
    v_job analysis_jobs[] := '{}';
    v_position bigint[] := '{}';
    -- The jobs the batch started, in answer order: the range of each answer's in v_started
    -- (v_from .. v_to), and whether it is the answer's own job or one it promoted.
    v_started analysis_jobs[] := '{}';
    v_own boolean[] := '{}';
    v_from integer[] := '{}';
    v_to integer[] := '{}';
    v_p analysis_jobs;
    n integer := 0;
    k integer;
BEGIN
    -- Held shared to commit, as every admit does with the ceiling off (and so that a change of
    -- the ceiling waits for this batch), and taken before any user's lock; the single-click
    -- calls below then find it held.
    PERFORM aq_lock_global_shared_v1();
    -- Then every user's lock, sorted, each waited for a moment at most: a user still busy is
    -- left to decide alone (their clicks, all of them: none overtakes another).
    v_busy := aq_lock_users_v1(
        ARRAY(SELECT x.user_id FROM jsonb_to_recordset(p_items) AS x(user_id text)),
        aq_batch_lock_wait_ms_v1());
    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, job_id uuid, user_id text, run_id uuid, core_run_id text,
            thesis jsonb, sources jsonb, cost integer, delta_of uuid, idempotency_key text,
            request_hash text)
        ORDER BY x.item
    LOOP
        n := n + 1;
        job := NULL;
        queue_position := NULL;
        v_from := v_from || (cardinality(v_started) + 1);
        IF r.user_id = ANY (v_busy) THEN
            outcome := 'busy';
        ELSIF NOT aq_reservation_held_v1(r.run_id) THEN
            outcome := 'reservation_gone';
        ELSIF r.cost > 0 AND coalesce(
                (SELECT a.balance FROM credit_accounts a WHERE a.user_id = r.user_id), 0)
                < r.cost THEN
            outcome := 'insufficient_credits';
        ELSE
            -- (A composite cannot be one of several INTO targets: through a record.)
            SELECT a.* INTO v_admitted
              FROM aq_admit_v2(r.job_id, r.user_id, r.run_id, r.core_run_id, r.thesis,
                               r.sources, r.cost, r.delta_of, r.idempotency_key,
                               r.request_hash) a;
            job := v_admitted.job;
            queue_position := v_admitted.queue_position;
            FOREACH v_p IN ARRAY coalesce(v_admitted.promoted, '{}') LOOP
                v_started := array_append(v_started, v_p);
                v_own := v_own || false;
            END LOOP;
            IF job.status = 'pending'
               AND NOT job.id = ANY (ARRAY(SELECT x.id FROM unnest(v_admitted.promoted) x)) THEN
                v_started := array_append(v_started, job);
                v_own := v_own || true;
            END IF;
            outcome := 'admitted';
        END IF;
        v_to := v_to || cardinality(v_started);
        v_item := v_item || r.item;
        v_outcome := v_outcome || outcome;
        v_job := array_append(v_job, job);
        v_position := v_position || queue_position;
    END LOOP;
    -- One claim for the whole batch (PostgreSQL prepares the table's CHECK constraints once
    -- per writing statement), returned in the order given, claimed or as they were.
    v_started := aq_claim_started_v1(v_started, p_instance, p_lease_s);
    FOR i IN 1 .. n LOOP
        item := v_item[i];
        outcome := v_outcome[i];
        job := v_job[i];
        queue_position := v_position[i];
        promoted := '{}';
        FOR k IN v_from[i] .. v_to[i] LOOP
            IF v_own[k] THEN
                job := v_started[k];
            ELSE
                promoted := array_append(promoted, v_started[k]);
            END IF;
        END LOOP;
        RETURN NEXT;
    END LOOP;
END
$$;
