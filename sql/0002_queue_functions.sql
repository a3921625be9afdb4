-- 0002_queue_functions: the queue's decisions, each one function called in one round trip.
--
-- Every function that takes or frees a slot first calls aq_lock_user_v1 in a statement of its
-- own. The functions are VOLATILE PL/pgSQL, so under READ COMMITTED every later statement takes
-- a fresh snapshot: the INSERT/UPDATE after the lock sees every row committed by whoever held
-- the lock before. (Inside one statement, or under REPEATABLE READ, it would not.)

-- The one place the user lock key is spelled. Admit, promotion, completion, cancel and the sweep
-- all lock through here, so old and new versions overlapping in a rolling deploy agree on it.
CREATE FUNCTION aq_lock_user_v1(p_user_id text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('analysis_queue:' || p_user_id, 0));
END
$$;

-- Reserve a run id before Core is asked for a held run; check the balance; resolve an
-- Idempotency-Key. Outcomes: reserved | existing | in_progress | key_reused | insufficient_credits.
CREATE FUNCTION aq_reserve_v1(
    p_user_id text, p_run_id uuid, p_job_id uuid, p_cost integer,
    p_thesis jsonb, p_sources jsonb, p_idempotency_key text, p_request_hash text,
    OUT outcome text, OUT job_id uuid, OUT balance bigint)
LANGUAGE plpgsql VOLATILE AS $$
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

-- Lock held: promote the user's oldest queued first-pass job if no first-pass job is active.
-- Returns the promoted row, or NULL.
CREATE FUNCTION aq_promote_locked_v1(p_user_id text) RETURNS analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_job analysis_jobs;
BEGIN
    IF EXISTS (
        SELECT 1 FROM analysis_jobs a
         WHERE a.user_id = p_user_id
           AND a.status IN ('pending', 'running')
           AND a.delta_of_job_id IS NULL
           AND a.deleted_at IS NULL
    ) THEN
        RETURN NULL;
    END IF;
    -- status = 'queued' is repeated outside the subquery: after a row-lock wait READ COMMITTED
    -- re-checks only the outer WHERE, and a job cancelled meanwhile must stay cancelled.
    UPDATE analysis_jobs j
       SET status = 'pending', promoted_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE j.id = (
            SELECT q.id FROM analysis_jobs q
             WHERE q.user_id = p_user_id AND q.status = 'queued'
             ORDER BY q.queue_seq
             LIMIT 1)
       AND j.status = 'queued'
    RETURNING j.* INTO v_job;
    RETURN v_job;
END
$$;

CREATE FUNCTION aq_promote_next_v1(p_user_id text) RETURNS analysis_jobs
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM aq_lock_user_v1(p_user_id);
    RETURN aq_promote_locked_v1(p_user_id);
END
$$;

-- Admit: under the user lock, debit and insert the job whose status is the write-up's CASE.
-- Raises AQ402 (insufficient credits) or AQ410 (the reservation was reclaimed by the sweep);
-- either rolls the whole admit back. Returns the job and, when queued, its position.
CREATE FUNCTION aq_admit_v1(
    p_job_id uuid, p_user_id text, p_run_id uuid, p_core_run_id text,
    p_thesis jsonb, p_sources jsonb, p_cost integer, p_delta_of uuid,
    p_idempotency_key text, p_request_hash text,
    OUT job analysis_jobs, OUT queue_position bigint)
LANGUAGE plpgsql VOLATILE AS $$
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

    INSERT INTO analysis_jobs
        (id, user_id, run_id, core_run_id, status, delta_of_job_id, thesis, sources, cost,
         idempotency_key, request_hash, promoted_at)
    SELECT p_job_id, p_user_id, p_run_id, p_core_run_id, d.status, p_delta_of, p_thesis,
           p_sources, p_cost, p_idempotency_key, p_request_hash,
           CASE WHEN d.status = 'pending' THEN clock_timestamp() END
      FROM (SELECT CASE WHEN p_delta_of IS NULL AND EXISTS (
                       SELECT 1 FROM analysis_jobs b
                        WHERE b.user_id = p_user_id
                          AND b.delta_of_job_id IS NULL
                          AND b.deleted_at IS NULL
                          AND b.status IN ('queued', 'pending', 'running'))
                   THEN 'queued' ELSE 'pending' END AS status) d
    RETURNING * INTO job;

    IF p_cost > 0 THEN
        INSERT INTO credit_ledger (user_id, job_id, kind, amount)
        VALUES (p_user_id, p_job_id, 'debit', p_cost);
    END IF;
    -- Counted here, in a statement of its own under the lock, so the answer to the click
    -- carries its true position without another round trip.
    IF job.status = 'queued' THEN
        SELECT count(*) INTO queue_position FROM analysis_jobs q
         WHERE q.user_id = p_user_id AND q.status = 'queued' AND q.queue_seq <= job.queue_seq;
    END IF;
END
$$;

-- Move a job to a terminal status (and/or soft-delete it) under its user's lock, refund what
-- never reached judging, and promote the user's next job in the same transaction.
--   p_job_id or p_core_run_id picks the job; p_user_id, when given, scopes it to that user.
--   p_status NULL means "only soft-delete"; the move happens only from a status in p_from.
--   p_ran: Core judged the run, so it started even if ``running`` was never written (a fast
--   callback can beat the releasing instance's update).
-- Refunds: a failed job, or one cancelled before it ran (queued or pending). At most once, by
-- the credit_ledger_one_refund index.
CREATE FUNCTION aq_finish_v1(
    p_job_id uuid, p_core_run_id text, p_user_id text,
    p_status text, p_from text[], p_delete boolean,
    p_error_code text, p_error_detail text, p_verdicts jsonb, p_ran boolean,
    OUT job analysis_jobs, OUT old_status text, OUT changed boolean,
    OUT promoted analysis_jobs)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_user text;
    v_id uuid;
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

    IF changed AND job.delta_of_job_id IS NULL THEN
        promoted := aq_promote_locked_v1(v_user);
    END IF;
END
$$;

-- Grant credits (admin). Returns the new balance.
CREATE FUNCTION aq_credit_grant_v1(p_user_id text, p_amount bigint, p_note text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_balance bigint;
BEGIN
    INSERT INTO credit_accounts (user_id, balance) VALUES (p_user_id, p_amount)
    ON CONFLICT (user_id) DO UPDATE
        SET balance = credit_accounts.balance + EXCLUDED.balance, updated_at = clock_timestamp()
    RETURNING balance INTO v_balance;
    INSERT INTO credit_ledger (user_id, kind, amount, note)
    VALUES (p_user_id, 'grant', p_amount, p_note);
    RETURN v_balance;
END
$$;
