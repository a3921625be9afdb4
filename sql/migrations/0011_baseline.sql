-- 0011_baseline: the tables, indexes and data of schema version 11, for an empty database.
--
-- A database with history (migrations 1 to 11 applied one by one by an earlier release) skips
-- this file; an empty one gets it instead of that history, and both go on from version 12. The
-- history itself is kept in git and, for the upgrade test, in tests/fixtures/release_0011/.
-- Functions and triggers are not here: they live in sql/functions/ and triggers/, applied after
-- every numbered migration (docs/operations.md, "Schema changes").
--
-- The invariants the queue depends on are constraints here, not code:
--   * no two active first-pass jobs of a user share a user slot (analysis_jobs_user_slot), and
--     no two active jobs share a global slot (analysis_jobs_global_slot);
--   * at most one debit and one refund per job (credit_ledger_one_debit, _one_refund);
--   * a balance never goes negative (credit_accounts_balance_nonnegative);
--   * a queued job says why it waits, and only a job waiting for capacity has a turn key.
-- Column order follows the history's (columns added by ALTER TABLE come last), so a baselined
-- database and an upgraded one have the same catalog (tests/integration/test_migrations.py).

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
    -- Slots: an active first-pass job holds a user slot (1..its user's limit); with the
    -- provider ceiling on, every active job holds a global slot (1..the ceiling).
    user_slot           integer,
    global_slot         integer,
    -- A queued job's wait: your_previous_analysis (its user is at their limit) or
    -- provider_capacity (its user has room; the ceiling is full). Ready jobs carry a turn key.
    waiting_for         text,
    turn_key            timestamptz,
    CONSTRAINT analysis_jobs_terminal_has_finished CHECK (
        (status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)),
    CONSTRAINT analysis_jobs_deleted_is_terminal CHECK (
        deleted_at IS NULL OR status IN ('succeeded', 'failed', 'cancelled')),
    CONSTRAINT analysis_jobs_user_slot_range CHECK (user_slot BETWEEN 1 AND 100),
    CONSTRAINT analysis_jobs_global_slot_range CHECK (global_slot BETWEEN 1 AND 1000000),
    CONSTRAINT analysis_jobs_active_has_user_slot CHECK (
        status NOT IN ('pending', 'running') OR delta_of_job_id IS NOT NULL
        OR user_slot IS NOT NULL),
    CONSTRAINT analysis_jobs_waiting_for CHECK (
        (status = 'queued') = (waiting_for IS NOT NULL)
        AND waiting_for IN ('your_previous_analysis', 'provider_capacity')),
    CONSTRAINT analysis_jobs_ready_has_turn CHECK (
        (waiting_for IS NOT DISTINCT FROM 'provider_capacity') = (turn_key IS NOT NULL)),
    -- A delta never waits behind its user's queue, only for the provider.
    CONSTRAINT analysis_jobs_delta_waits_for_capacity CHECK (
        delta_of_job_id IS NULL OR status <> 'queued' OR waiting_for = 'provider_capacity')
);

-- The per-user invariant: no two active first-pass jobs of a user share a slot. With the default
-- limit of 1, at most one is active. A promotion that races another one gets 23505.
CREATE UNIQUE INDEX analysis_jobs_user_slot
    ON analysis_jobs (user_id, user_slot)
    WHERE status IN ('pending', 'running') AND delta_of_job_id IS NULL;

-- The global invariant: no two active jobs share a global slot.
CREATE UNIQUE INDEX analysis_jobs_global_slot
    ON analysis_jobs (global_slot)
    WHERE status IN ('pending', 'running') AND global_slot IS NOT NULL;

-- A user's queue is their queued first-pass jobs in admission order (a delta that waits, for
-- capacity only, is not in it). Carrying each job's wait keeps the queue's counts, heads and the
-- sweep's scan index-only, whatever the history.
CREATE INDEX analysis_jobs_queued
    ON analysis_jobs (user_id, queue_seq) INCLUDE (waiting_for)
    WHERE status = 'queued' AND delta_of_job_id IS NULL;

-- The turn order: ready jobs, fairest first. Holds only what waits for capacity.
CREATE INDEX analysis_jobs_turns
    ON analysis_jobs (turn_key, queue_seq)
    WHERE status = 'queued' AND waiting_for = 'provider_capacity';

CREATE INDEX analysis_jobs_ready_by_user
    ON analysis_jobs (user_id, queue_seq)
    WHERE status = 'queued' AND waiting_for = 'provider_capacity';

-- Work the dispatcher and the sweep look at: pending and running jobs only.
CREATE INDEX analysis_jobs_active
    ON analysis_jobs (status, next_release_at)
    WHERE status IN ('pending', 'running');

-- The sweep's "running jobs not heard of lately": an index range over the quiet ones (usually
-- none) instead of every running job's scattered row.
CREATE INDEX analysis_jobs_running_quiet
    ON analysis_jobs ((coalesce(last_polled_at, started_at)))
    WHERE status = 'running';

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

-- The event stream's log: per user, gapless, in commit order (triggers/job_events.sql). Ids come
-- from the user's counter row, not a sequence: ids a sequence hands to concurrent transactions
-- are not in commit order, so "everything after id N" could miss a lower id that commits late.
-- Events are kept for a retention (the sweep prunes older ones); counters are kept forever.
CREATE TABLE job_event_counters (
    user_id     text PRIMARY KEY CHECK (length(user_id) BETWEEN 1 AND 200),
    last_id     bigint NOT NULL CHECK (last_id > 0)
);

-- No foreign key to analysis_jobs: jobs are never hard-deleted, and the event log must not
-- make a future hard delete (or its lock) depend on it. Readers join and tolerate a miss.
CREATE TABLE job_events (
    user_id     text NOT NULL,
    event_id    bigint NOT NULL,
    job_id      uuid NOT NULL,
    kind        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (user_id, event_id),
    CONSTRAINT job_events_kind_check CHECK (kind IN
        ('admitted', 'promoted', 'started', 'finished', 'cancelled', 'deleted', 'changed',
         'waiting'))
);

-- Pruning reads the oldest events first. Per user, created_at grows with event_id (it is taken
-- after the counter's row lock was granted), so a prune removes a prefix of each user's log.
CREATE INDEX job_events_created_at ON job_events (created_at);

-- The provider ceiling: NULL is off. Written at start by each instance from
-- AQ_GLOBAL_MAX_RUNNING (the last one started sets it for all).
CREATE TABLE queue_settings (
    id                  boolean PRIMARY KEY DEFAULT true CHECK (id),
    global_max_running  integer CHECK (global_max_running BETWEEN 1 AND 1000000),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO queue_settings DEFAULT VALUES;

-- Per-user concurrency for plans that allow more than one analysis at once (admin API).
CREATE TABLE user_limits (
    user_id      text PRIMARY KEY CHECK (length(user_id) BETWEEN 1 AND 200),
    max_running  integer NOT NULL CHECK (max_running BETWEEN 1 AND 100),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- When each user last started a first-pass job with the ceiling on: the round robin's memory.
CREATE TABLE user_turns (
    user_id       text PRIMARY KEY,
    last_turn_at  timestamptz NOT NULL
);
