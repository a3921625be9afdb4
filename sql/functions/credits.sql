-- credits: grants, and the refund rule. (The debit is part of the admit: admit.sql.)
--
-- The balance is a cache of the ledger, written in the same transaction as the ledger row:
-- balance = grants - debits + refunds at every commit. A job has at most one debit and one
-- refund (credit_ledger_one_debit, credit_ledger_one_refund), so no path can pay twice.

-- Grant credits (admin). Returns the new balance.
CREATE OR REPLACE FUNCTION aq_credit_grant_v1(p_user_id text, p_amount bigint, p_note text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET lock_timeout = '10s' SET plan_cache_mode = force_generic_plan AS $$
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

-- The refund rule, applied by the transaction that ends a job (finish.sql), under its user's
-- lock: a job that failed, or that was cancelled before it ran (queued or pending), gets its
-- cost back, once. Returns whether this call refunded.
CREATE OR REPLACE FUNCTION aq_refund_if_due_v1(p_job analysis_jobs, p_old_status text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_job.cost <= 0 OR NOT (
        p_job.status = 'failed'
        OR (p_job.status = 'cancelled' AND p_old_status IN ('queued', 'pending'))) THEN
        RETURN false;
    END IF;
    INSERT INTO credit_ledger (user_id, job_id, kind, amount)
    VALUES (p_job.user_id, p_job.id, 'refund', p_job.cost)
    ON CONFLICT (job_id) WHERE kind = 'refund' DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE credit_accounts
       SET balance = balance + p_job.cost, updated_at = clock_timestamp()
     WHERE user_id = p_job.user_id;
    RETURN true;
END
$$;
