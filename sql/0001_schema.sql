-- 0001_schema: jobs, credits, run reservations.
--
-- The invariants the queue depends on are constraints here, not code:
--   * one active (pending/running) first-pass job per user: analysis_jobs_one_active_first_pass
--   * at most one debit and one refund per job: credit_ledger_one_debit/_one_refund
--   * a balance never goes negative: credit_accounts_balance_nonnegative

-- FIFO order is drawn from this sequence by the admitting INSERT, i.e. after the user lock was
-- granted. now() (the transaction's start, taken before the lock wait) can disagree with the
-- order the lock admitted; created_at defaults to clock_timestamp() for the same reason.
CREATE SEQUENCE analysis_jobs_queue_seq;

CREATE TABLE analysis_jobs (
    id                  uuid PRIMARY KEY,
    user_id             text NOT NULL CHECK (length(user_id) BETWEEN 1 AND 200),
    run_id              uuid NOT NULL UNIQUE,
    core_run_id         text,
    status              text NOT NULL CHECK (status IN
                            ('queued', 'pending', 'running', 'succeeded', 'failed', 'cancelled')),
    queue_seq           bigint NOT NULL DEFAULT nextval('analysis_jobs_queue_seq'),
    delta_of_job_id     uuid REFERENCES analysis_jobs (id),
    deleted_at          timestamptz,
    thesis              jsonb NOT NULL,
    sources             jsonb NOT NULL,
    cost                integer NOT NULL CHECK (cost >= 0),
    idempotency_key     text,
    request_hash        text,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    promoted_at         timestamptz,
    started_at          timestamptz,
    finished_at         timestamptz,
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Release bookkeeping: a durable retry schedule that survives a redeploy.
    release_attempts    integer NOT NULL DEFAULT 0,
    next_release_at     timestamptz,
    claimed_by          text,
    claim_expires_at    timestamptz,
    last_polled_at      timestamptz,
    error_code          text,
    error_detail        text,
    verdicts            jsonb,
    CONSTRAINT analysis_jobs_terminal_has_finished CHECK (
        (status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)),
    CONSTRAINT analysis_jobs_deleted_is_terminal CHECK (
        deleted_at IS NULL OR status IN ('succeeded', 'failed', 'cancelled')),
    CONSTRAINT analysis_jobs_delta_never_queued CHECK (
        delta_of_job_id IS NULL OR status <> 'queued')
);

-- The per-user serialization invariant. A promotion that races another one gets 23505 instead
-- of a second active job.
CREATE UNIQUE INDEX analysis_jobs_one_active_first_pass
    ON analysis_jobs (user_id)
    WHERE status IN ('pending', 'running') AND delta_of_job_id IS NULL AND deleted_at IS NULL;

-- The queue: a user's waiting first-pass jobs in admission order. Small whatever the history.
CREATE INDEX analysis_jobs_queued
    ON analysis_jobs (user_id, queue_seq)
    WHERE status = 'queued';

-- Work the dispatcher and the sweep look at: pending and running jobs only.
CREATE INDEX analysis_jobs_active
    ON analysis_jobs (status, next_release_at)
    WHERE status IN ('pending', 'running');

CREATE UNIQUE INDEX analysis_jobs_core_run_id ON analysis_jobs (core_run_id);

CREATE UNIQUE INDEX analysis_jobs_idempotency
    ON analysis_jobs (user_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE INDEX analysis_jobs_user_listing ON analysis_jobs (user_id, created_at DESC);

CREATE INDEX analysis_jobs_delta_of ON analysis_jobs (delta_of_job_id)
    WHERE delta_of_job_id IS NOT NULL;

-- Credits: the balance is a cache of the ledger, kept in the same statements that write it:
-- balance = grants - debits + refunds at every commit.
CREATE TABLE credit_accounts (
    user_id     text PRIMARY KEY CHECK (length(user_id) BETWEEN 1 AND 200),
    balance     bigint NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT credit_accounts_balance_nonnegative CHECK (balance >= 0)
);

CREATE TABLE credit_ledger (
    id          bigserial PRIMARY KEY,
    user_id     text NOT NULL REFERENCES credit_accounts (user_id),
    job_id      uuid REFERENCES analysis_jobs (id),
    kind        text NOT NULL CHECK (kind IN ('grant', 'debit', 'refund')),
    amount      bigint NOT NULL CHECK (amount > 0),
    note        text,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT credit_ledger_job_kind CHECK ((kind = 'grant') = (job_id IS NULL))
);

CREATE UNIQUE INDEX credit_ledger_one_debit ON credit_ledger (job_id) WHERE kind = 'debit';
CREATE UNIQUE INDEX credit_ledger_one_refund ON credit_ledger (job_id) WHERE kind = 'refund';
CREATE INDEX credit_ledger_user ON credit_ledger (user_id, id);

-- A run id is reserved here before Core is asked for a held run, and the row is removed in the
-- transaction that inserts the job. A reservation that outlives its request names a held run
-- nobody owns: the sweep cancels it in Core.
CREATE TABLE core_run_reservations (
    run_id           uuid PRIMARY KEY,
    job_id           uuid NOT NULL,
    user_id          text NOT NULL,
    core_run_id      text,
    -- What Core was asked, so the sweep can re-ask (create is idempotent on run_id) to learn
    -- the Core id of a held run whose admit died before recording it, and cancel that run.
    thesis           jsonb NOT NULL,
    sources          jsonb NOT NULL,
    idempotency_key  text,
    request_hash     text,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE UNIQUE INDEX core_run_reservations_idempotency
    ON core_run_reservations (user_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE INDEX core_run_reservations_age ON core_run_reservations (created_at);
