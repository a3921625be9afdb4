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
--   ceiling off: aq_admit_ceiling_off_locked_v1 decides and writes (below), as for a batch: a
--     delta is pending; a first-pass job is pending when nothing of the user's waits and a
--     user slot is free, else queued for your_previous_analysis.
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
    v_wait text;
    v_turn timestamptz;
    v_room integer;
    v_started analysis_jobs;
    v_admitted record;
BEGIN
    promoted := '{}';
    v_ceiling := aq_ceiling_v2();
    IF v_ceiling IS NULL THEN
        -- Ceiling off: held shared until commit, so turning it on waits for this decision.
        PERFORM aq_lock_global_shared_v1();
        v_ceiling := aq_ceiling_v2();
    END IF;
    PERFORM aq_lock_user_v1(p_user_id);

    IF v_ceiling IS NULL THEN
        -- (A composite cannot be one of several INTO targets: through a record.)
        SELECT a.* INTO v_admitted
          FROM aq_admit_ceiling_off_locked_v1(jsonb_build_array(jsonb_build_object(
                   'item', 1, 'job_id', p_job_id, 'user_id', p_user_id, 'run_id', p_run_id,
                   'core_run_id', p_core_run_id, 'thesis', p_thesis, 'sources', p_sources,
                   'cost', p_cost, 'delta_of', p_delta_of,
                   'idempotency_key', p_idempotency_key, 'request_hash', p_request_hash))) a;
        IF v_admitted.outcome = 'reservation_gone' THEN
            RAISE EXCEPTION 'run reservation % no longer exists', p_run_id
                USING ERRCODE = 'AQ410';
        ELSIF v_admitted.outcome = 'insufficient_credits' THEN
            RAISE EXCEPTION 'insufficient credits' USING ERRCODE = 'AQ402';
        END IF;
        job := v_admitted.job;
        queue_position := v_admitted.queue_position;
        RETURN;
    END IF;

    -- Ceiling on.
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
        v_wait := 'provider_capacity';
        v_turn := '-infinity';
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
         idempotency_key, request_hash, created_at, updated_at, waiting_for, turn_key)
    VALUES
        (p_job_id, p_user_id, p_run_id, p_core_run_id, 'queued', p_delta_of, p_thesis,
         p_sources, p_cost, p_idempotency_key, p_request_hash, v_now, v_now, v_wait, v_turn)
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

-- The admits of many clicks with the ceiling off, the global lock held shared and every
-- click's user's lock held (aq_admit_v2 for one click, aq_admit_many_v1 for a batch). Each
-- click is decided for itself, in item order, seeing the clicks before it: its reservation must
-- still be held ('reservation_gone' otherwise) and its user's balance, less what the earlier
-- clicks debited, cover its cost ('insufficient_credits'); a delta is pending; a first-pass
-- job is pending in the lowest free user slot when nothing of its user's waits, else queued
-- for your_previous_analysis at the end of its user's queue. Then each table is written once
-- for all the admitted clicks, so the statements' preparation (the jobs table's indexes and
-- CHECK constraints, the event trigger) is paid once per batch, not per click
-- (docs/benchmarks.md). Returns one row per item: outcome 'admitted' with the job and, when
-- queued, its queue position, or the refusal.
-- p_items: [{"item": n, ...aq_admit_v2's arguments by name}, ...].
CREATE OR REPLACE FUNCTION aq_admit_ceiling_off_locked_v1(p_items jsonb)
RETURNS TABLE (item integer, outcome text, job analysis_jobs, queue_position bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    -- The batch's users (sorted) and what the decisions read and change: balance, queued
    -- first-pass jobs, limit, the user slots in use (an array literal).
    v_users text[];
    v_balance bigint[];
    v_queued bigint[];
    v_limit integer[];
    v_used text[];
    v_held uuid[];
    d integer;
    v_slot integer;
    -- Per item, in order: outcome, status, slot, queue position; and the admitted ones' index.
    v_items integer[] := '{}';
    v_outcomes text[] := '{}';
    v_positions bigint[] := '{}';
    v_index integer[] := '{}';
    -- The admitted jobs' columns, for the writes.
    a_id uuid[] := '{}';
    a_user text[] := '{}';
    a_run uuid[] := '{}';
    a_core text[] := '{}';
    a_status text[] := '{}';
    a_delta uuid[] := '{}';
    a_thesis jsonb[] := '{}';
    a_sources jsonb[] := '{}';
    a_cost integer[] := '{}';
    a_key text[] := '{}';
    a_hash text[] := '{}';
    a_slot integer[] := '{}';
    a_wait text[] := '{}';
    v_jobs analysis_jobs[];
    n integer := 0;
BEGIN
    SELECT array_agg(u.user_id ORDER BY u.user_id),
           array_agg(coalesce(a.balance, 0) ORDER BY u.user_id),
           array_agg(q.n ORDER BY u.user_id),
           array_agg(s.max_running ORDER BY u.user_id),
           array_agg(s.used::text ORDER BY u.user_id)
      INTO v_users, v_balance, v_queued, v_limit, v_used
      FROM (SELECT DISTINCT x.user_id FROM jsonb_to_recordset(p_items) AS x(user_id text)) u
      LEFT JOIN credit_accounts a ON a.user_id = u.user_id
      CROSS JOIN LATERAL (SELECT count(*) AS n FROM analysis_jobs b
                           WHERE b.user_id = u.user_id AND b.status = 'queued'
                             AND b.delta_of_job_id IS NULL) q
      CROSS JOIN LATERAL aq_user_slots_v1(u.user_id) s;
    -- Row-locked (the sweep's reclaim skips locked rows), so each stays until it is deleted.
    SELECT coalesce(array_agg(h.run_id), '{}') INTO v_held FROM (
        SELECT c.run_id FROM core_run_reservations c
         WHERE c.run_id = ANY (ARRAY(SELECT x.run_id
                                       FROM jsonb_to_recordset(p_items) AS x(run_id uuid)))
           FOR UPDATE) h;

    FOR r IN
        SELECT * FROM jsonb_to_recordset(p_items) AS x(
            item integer, job_id uuid, user_id text, run_id uuid, core_run_id text,
            thesis jsonb, sources jsonb, cost integer, delta_of uuid, idempotency_key text,
            request_hash text)
        ORDER BY x.item
    LOOP
        d := array_position(v_users, r.user_id);
        v_items := v_items || r.item;
        v_positions := v_positions || NULL::bigint;
        v_index := v_index || NULL::integer;
        IF NOT r.run_id = ANY (v_held) THEN
            v_outcomes := v_outcomes || 'reservation_gone'::text;
            CONTINUE;
        END IF;
        IF r.cost > 0 AND v_balance[d] < r.cost THEN
            v_outcomes := v_outcomes || 'insufficient_credits'::text;
            CONTINUE;
        END IF;
        v_outcomes := v_outcomes || 'admitted'::text;
        v_held := array_remove(v_held, r.run_id);  -- a run is admitted once
        v_balance[d] := v_balance[d] - greatest(r.cost, 0);
        v_slot := NULL;
        IF r.delta_of IS NULL AND v_queued[d] = 0 THEN
            v_slot := (aq_free_slots_v1(v_limit[d], v_used[d]::integer[]))[1];
        END IF;
        n := n + 1;
        v_index[cardinality(v_index)] := n;
        IF r.delta_of IS NOT NULL OR v_slot IS NOT NULL THEN
            a_status := a_status || 'pending'::text;
            a_wait := a_wait || NULL::text;
            IF v_slot IS NOT NULL THEN
                v_used[d] := (v_used[d]::integer[] || v_slot)::text;
            END IF;
        ELSE
            a_status := a_status || 'queued'::text;
            a_wait := a_wait || 'your_previous_analysis'::text;
            v_queued[d] := v_queued[d] + 1;
            v_positions[cardinality(v_positions)] := v_queued[d];
        END IF;
        a_id := a_id || r.job_id;
        a_user := a_user || r.user_id;
        a_run := a_run || r.run_id;
        a_core := a_core || r.core_run_id;
        a_delta := a_delta || r.delta_of;
        a_thesis := a_thesis || r.thesis;
        a_sources := a_sources || r.sources;
        a_cost := a_cost || r.cost;
        a_key := a_key || r.idempotency_key;
        a_hash := a_hash || r.request_hash;
        a_slot := a_slot || v_slot;
    END LOOP;

    IF n > 0 THEN
        DELETE FROM core_run_reservations c WHERE c.run_id = ANY (a_run);
        UPDATE credit_accounts a
           SET balance = a.balance - d.total, updated_at = clock_timestamp()
          FROM (SELECT x.u, sum(x.c) AS total FROM unnest(a_user, a_cost) AS x(u, c)
                 WHERE x.c > 0 GROUP BY x.u) d
         WHERE a.user_id = d.u;
        -- In item order, so each job's queue_seq (its default, drawn row by row) follows the
        -- order the clicks were decided in.
        WITH admitted AS (
            INSERT INTO analysis_jobs AS j
                (id, user_id, run_id, core_run_id, status, delta_of_job_id, thesis, sources,
                 cost, idempotency_key, request_hash, created_at, updated_at, promoted_at,
                 user_slot, waiting_for)
            SELECT x.id, x.u, x.run, x.core, x.status, x.delta, x.thesis, x.sources, x.cost,
                   x.key, x.hash, clock_timestamp(), clock_timestamp(),
                   CASE WHEN x.status = 'pending' THEN clock_timestamp() END, x.slot, x.wait
              FROM unnest(a_id, a_user, a_run, a_core, a_status, a_delta, a_thesis, a_sources,
                          a_cost, a_key, a_hash, a_slot, a_wait)
                   AS x(id, u, run, core, status, delta, thesis, sources, cost, key, hash,
                        slot, wait)
            RETURNING j)
        SELECT array_agg(a.j ORDER BY array_position(a_id, (a.j).id)) INTO v_jobs FROM admitted a;
        INSERT INTO credit_ledger (user_id, job_id, kind, amount)
        SELECT x.u, x.id, 'debit', x.c FROM unnest(a_user, a_id, a_cost) AS x(u, id, c)
         WHERE x.c > 0;
    END IF;

    FOR i IN 1 .. cardinality(v_items) LOOP
        item := v_items[i];
        outcome := v_outcomes[i];
        job := CASE WHEN v_index[i] IS NOT NULL THEN v_jobs[v_index[i]] END;
        queue_position := v_positions[i];
        RETURN NEXT;
    END LOOP;
END
$$;

-- Group commits (queue/admit.py): the reservations, and the admits, of the clicks that arrive
-- while the previous batch is being written, in one transaction each. Every click is decided
-- for itself, in arrival order, by the functions above: with the ceiling off all at once by
-- aq_admit_ceiling_off_locked_v1, with it on one by one by aq_admit_v2. A click whose user's lock
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
-- 'insufficient_credits', 'reservation_gone' (the refusals aq_admit_v2 raises, decided
-- before anything of the click is written, so they roll back nothing of the batch), or 'busy'.
-- The jobs the admits started are claimed for p_instance, which releases them, all in one
-- statement once every click is decided (aq_claim_started_v1), and the rows come back after it.
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
    v_ceiling integer;
    -- With the ceiling off, the answers of aq_admit_ceiling_off_locked_v1, by item.
    v_off_item integer[];
    v_off_outcome text[];
    v_off_job analysis_jobs[];
    v_off_position bigint[];
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
    -- Read under the global lock held shared: it cannot change before this commits.
    v_ceiling := aq_ceiling_v2();
    IF v_ceiling IS NULL THEN
        -- Every click whose user is locked, decided and written at once.
        SELECT array_agg(a.item ORDER BY a.item), array_agg(a.outcome ORDER BY a.item),
               array_agg(a.job ORDER BY a.item), array_agg(a.queue_position ORDER BY a.item)
          INTO v_off_item, v_off_outcome, v_off_job, v_off_position
          FROM aq_admit_ceiling_off_locked_v1(
                   (SELECT coalesce(jsonb_agg(e), '[]') FROM jsonb_array_elements(p_items) e
                     WHERE NOT (e ->> 'user_id') = ANY (v_busy))) a;
    END IF;
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
        ELSIF v_ceiling IS NULL THEN
            k := array_position(v_off_item, r.item);
            outcome := v_off_outcome[k];
            job := v_off_job[k];
            queue_position := v_off_position[k];
            IF job.status = 'pending' THEN
                v_started := array_append(v_started, job);
                v_own := v_own || true;
            END IF;
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
