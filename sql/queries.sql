-- The queue's named queries, loaded once into a dict by store/sqlfiles.py.
-- Each block: a "-- name --" line, a line saying what it does and its parameters, then the SQL.
-- The decisions that need locks are SQL functions (sql/functions/, locks in docs/locking.md);
-- these queries call them or do what needs no lock.

-- admit --
-- Admit a reserved run as a job (aq_admit_v2): $1 job id, $2 user, $3 run id, $4 Core run id,
-- $5 thesis, $6 sources, $7 cost, $8 delta_of job id, $9 idempotency key, $10 request hash.
-- -> the job's columns, its queue position, and the jobs the admit promoted.
SELECT (r.job).*, r.queue_position, r.promoted
  FROM aq_admit_v2($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) r;

-- admit_many --
-- The admits of a group commit (aq_admit_many_v1): $1 [{"item", aq_admit_v2's arguments}],
-- $2 the instance that releases what they start, $3 its claim lease in seconds.
-- -> per item: its outcome, and when admitted the job's columns, its position and what it
-- promoted (claimed for $2).
SELECT r.item, r.outcome, (r.job).*, r.queue_position, r.promoted
  FROM aq_admit_many_v1($1, $2, $3) r;

-- reserve_many --
-- The reservations of a group commit (aq_reserve_many_v1): $1 [{"item", aq_reserve_v1's
-- arguments}]. -> per item: outcome, job_id, balance.
SELECT * FROM aq_reserve_many_v1($1);

-- reserve --
-- Reserve a run id and check credit: $1 user, $2 run id, $3 job id, $4 cost, $5 thesis,
-- $6 sources, $7 idempotency key, $8 request hash. -> outcome, job_id, balance
SELECT * FROM aq_reserve_v1($1, $2, $3, $4, $5, $6, $7, $8);

-- promote --
-- Fill free slots (aq_promote_v2): $1 users whose slot freed (may be empty); $2 at most.
-- -> the ceiling in force on every row, and the promoted jobs (one all-NULL job when none).
SELECT p.ceiling, (p.job).*, NULL::bigint AS queue_position FROM aq_promote_v2($1, $2) p;

-- promote_woken --
-- A notification woke these users (aq_promote_woken_v1): $1 users, $2 at most. -> the ceiling
-- in force on every row, and jobs it promoted (promoted true) or found pending and unreleased
-- (false); one all-NULL job when none.
SELECT w.ceiling, w.promoted, (w.job).*, NULL::bigint AS queue_position
  FROM aq_promote_woken_v1($1, $2) w;

-- finish --
-- Terminal move and/or soft delete under the user lock, refund, tail promotion (aq_finish_v2):
-- $1 job id, $2 Core run id, $3 user scope, $4 status, $5 from statuses, $6 delete,
-- $7 error code, $8 error detail, $9 verdicts, $10 Core judged it.
-- -> job, old_status, changed, refunded, promoted (an array of jobs)
SELECT * FROM aq_finish_v2($1, $2, $3, $4, $5, $6, $7, $8, $9, $10);

-- finish_many --
-- Core's completions of a group commit (aq_finish_many_v1): $1 [{"item", "core_run_id",
-- "status", "from", "error_code", "error_detail", "verdicts", "ran"}], $2 the instance that
-- releases what they promote, $3 its claim lease in seconds.
-- -> per item: its outcome and aq_finish_v2's columns (the promoted jobs claimed for $2).
SELECT * FROM aq_finish_many_v1($1, $2, $3);

-- ceiling_set --
-- Set the global ceiling (NULL: off), waiting for decisions in flight: $1 ceiling.
SELECT aq_set_ceiling_v1($1) AS ceiling;

-- capacity --
-- The ceiling, global slots in use, and who waits for capacity (reads the partial indexes).
SELECT (SELECT s.global_max_running FROM queue_settings s) AS ceiling,
       (SELECT count(*) FROM analysis_jobs WHERE status IN ('pending', 'running')) AS active,
       (SELECT count(*) FROM analysis_jobs
         WHERE status = 'queued' AND waiting_for = 'provider_capacity') AS jobs_waiting,
       (SELECT count(DISTINCT user_id) FROM analysis_jobs
         WHERE status = 'queued' AND waiting_for = 'provider_capacity') AS users_waiting;

-- user_limit_set --
-- Set a user's concurrency (NULL: the default, 1) and fill what it frees: $1 user, $2 limit.
-- -> the jobs promoted.
SELECT j.*, NULL::bigint AS queue_position FROM aq_set_user_limit_v1($1, $2) j;

-- user_limit_get --
-- A user's concurrency and what they have active and queued: $1 user.
SELECT aq_user_limit_v1($1) AS max_running,
       (SELECT l.user_id IS NOT NULL FROM user_limits l WHERE l.user_id = $1) AS custom,
       (SELECT count(*) FROM analysis_jobs a
         WHERE a.user_id = $1 AND a.status IN ('pending', 'running')
           AND a.delta_of_job_id IS NULL) AS active,
       (SELECT count(*) FROM analysis_jobs q
         WHERE q.user_id = $1 AND q.status = 'queued' AND q.delta_of_job_id IS NULL) AS queued;

-- credit_grant --
-- Grant credits: $1 user, $2 amount, $3 note. -> balance
SELECT aq_credit_grant_v1($1, $2, $3) AS balance;

-- credit_balance --
-- A user's balance: $1 user.
SELECT coalesce((SELECT balance FROM credit_accounts WHERE user_id = $1), 0) AS balance;

-- job_open_counts --
-- Open jobs by status, for metrics: reads only the partial indexes of open work (queued
-- first-pass jobs, then deltas waiting for capacity).
SELECT 'queued' AS status,
       (SELECT count(*) FROM analysis_jobs
         WHERE status = 'queued' AND delta_of_job_id IS NULL)
     + (SELECT count(*) FROM analysis_jobs
         WHERE status = 'queued' AND waiting_for = 'provider_capacity'
           AND delta_of_job_id IS NOT NULL) AS n
UNION ALL
SELECT status, count(*) FROM analysis_jobs WHERE status IN ('pending', 'running') GROUP BY status;

-- job_get --
-- One job of one user, with its queue position: $1 job id, $2 user.
SELECT j.*,
       CASE WHEN j.status = 'queued' AND j.delta_of_job_id IS NULL THEN (
           SELECT count(*) FROM analysis_jobs q
            WHERE q.user_id = j.user_id AND q.status = 'queued' AND q.queue_seq <= j.queue_seq
              AND q.delta_of_job_id IS NULL)
       END AS queue_position
  FROM analysis_jobs j
 WHERE j.id = $1 AND j.user_id = $2 AND j.deleted_at IS NULL;

-- job_list_page --
-- A page of a user's jobs as summaries, newest first, deleted ones hidden, with queue
-- positions: $1 user, $2 only jobs admitted before this queue_seq (NULL: from the newest), $3 at
-- most this many. A keyset on queue_seq, which each admit draws under its user's lock: a job
-- admitted meanwhile sorts before the first page and never shifts a later one.
WITH page AS (
    SELECT s.*
      FROM aq_job_summaries_v1 s
     WHERE s.user_id = $1 AND s.deleted_at IS NULL AND ($2::bigint IS NULL OR s.queue_seq < $2)
     ORDER BY s.queue_seq DESC
     LIMIT $3)
SELECT page.*, p.queue_position
  FROM page
  LEFT JOIN (SELECT q.id, row_number() OVER (ORDER BY q.queue_seq) AS queue_position
               FROM analysis_jobs q
              WHERE q.user_id = $1 AND q.status = 'queued'
                AND q.delta_of_job_id IS NULL) p ON p.id = page.id
 ORDER BY page.queue_seq DESC;

-- jobs_claim --
-- Claim pending jobs for release, so that only one instance releases each: $1 job ids,
-- $2 instance id, $3 lease seconds. Compare-and-set on status, lease and retry schedule; returns
-- the jobs claimed. One statement for every dispatch that asked while the previous one ran.
-- SKIP LOCKED: a claim never waits while holding other rows (two instances claim overlapping
-- sets: both hear every NOTIFY). A row someone holds is another instance's claim (theirs) or a
-- finish or cancel (it moves on); the rare holder that changes nothing (a cancel that found the
-- job no longer queued, then could not reach Core) leaves the job to the sweep's pending pass.
UPDATE analysis_jobs j
   SET claimed_by = $2,
       claim_expires_at = clock_timestamp() + make_interval(secs => $3),
       release_attempts = j.release_attempts + 1,
       updated_at = clock_timestamp()
  FROM (SELECT c.id FROM analysis_jobs c
         WHERE c.id = ANY ($1::uuid[])
           AND c.status = 'pending'
           AND (c.claim_expires_at IS NULL OR c.claim_expires_at < clock_timestamp())
           AND (c.next_release_at IS NULL OR c.next_release_at <= clock_timestamp())
           FOR UPDATE SKIP LOCKED) free
 WHERE j.id = free.id
RETURNING j.*, NULL::bigint AS queue_position;

-- jobs_mark_running --
-- Core released the runs: $1 job ids, $2 the instance that claimed them, $3 whether to wait for
-- users' locks held elsewhere (aq_mark_running_v2). Returns each job still pending for $2 and
-- whether it moved (nobody reads more of them: a whole row per job was a twelfth of the
-- service's time in the drain). One commit, and one turn at NOTIFY's commit lock, for every
-- release that completed while the previous one was being written.
SELECT m.job_id, m.moved FROM aq_mark_running_v2($1::uuid[], $2, $3) m;

-- job_release_retry --
-- A release attempt failed and may be retried: $1 job id, $2 instance id, $3 next attempt at,
-- $4 error detail. Not a status change: no NOTIFY.
UPDATE analysis_jobs
   SET next_release_at = $3, claimed_by = NULL, claim_expires_at = NULL,
       error_code = 'release_retrying', error_detail = $4, updated_at = clock_timestamp()
 WHERE id = $1 AND status = 'pending' AND claimed_by = $2;

-- job_mark_polled --
-- The sweep asked Core about these running jobs: $1 job ids.
UPDATE analysis_jobs SET last_polled_at = clock_timestamp() WHERE id = ANY ($1);

-- job_for_recheck --
-- The job a delta re-check refers to: $1 job id, $2 user.
SELECT id, user_id, thesis, sources, status, delta_of_job_id
  FROM analysis_jobs
 WHERE id = $1 AND user_id = $2 AND deleted_at IS NULL;

-- sweep_users_to_promote --
-- Users a promotion may have missed: $1 limit. A user with room (fewer active first-pass jobs
-- than their limit) whose oldest queued job does not wait for capacity: with the ceiling off it
-- should have started, with it on its wait was not re-derived. Also, ceiling off, a user with a
-- waiting delta. Ready users are the promotion pass's business.
-- Users on the default limit of 1 are an anti-join over the partial indexes; users with a plan
-- limit (few) are counted one by one.
WITH settings AS (SELECT s.global_max_running IS NULL AS off FROM queue_settings s),
heads AS (
    SELECT DISTINCT ON (q.user_id) q.user_id, q.waiting_for
      FROM analysis_jobs q
     WHERE q.status = 'queued' AND q.delta_of_job_id IS NULL
     ORDER BY q.user_id, q.queue_seq)
SELECT h.user_id
  FROM heads h
 WHERE (h.waiting_for = 'your_previous_analysis' OR (SELECT off FROM settings))
   AND NOT EXISTS (SELECT 1 FROM user_limits l WHERE l.user_id = h.user_id)
   AND NOT EXISTS (
        SELECT 1 FROM analysis_jobs a
         WHERE a.user_id = h.user_id
           AND a.status IN ('pending', 'running')
           AND a.delta_of_job_id IS NULL)
UNION
SELECT l.user_id
  FROM user_limits l
 WHERE (SELECT q.waiting_for = 'your_previous_analysis' OR (SELECT off FROM settings)
          FROM analysis_jobs q
         WHERE q.user_id = l.user_id AND q.status = 'queued' AND q.delta_of_job_id IS NULL
         ORDER BY q.queue_seq
         LIMIT 1)
   AND (SELECT count(*) FROM analysis_jobs a
         WHERE a.user_id = l.user_id
           AND a.status IN ('pending', 'running')
           AND a.delta_of_job_id IS NULL) < l.max_running
UNION
SELECT d.user_id
  FROM analysis_jobs d
 WHERE d.status = 'queued' AND d.waiting_for = 'provider_capacity'
   AND d.delta_of_job_id IS NOT NULL
   AND (SELECT off FROM settings)
 LIMIT $1;

-- sweep_pending_due --
-- Pending jobs nobody is releasing whose next attempt is due: $1 limit.
SELECT id
  FROM analysis_jobs
 WHERE status = 'pending'
   AND (next_release_at IS NULL OR next_release_at <= clock_timestamp())
   AND (claim_expires_at IS NULL OR claim_expires_at < clock_timestamp())
 ORDER BY promoted_at
 LIMIT $1;

-- sweep_running_quiet --
-- Running jobs not heard of for $1 seconds (callback maybe lost): $2 limit.
SELECT id, core_run_id
  FROM analysis_jobs
 WHERE status = 'running'
   -- now(), not clock_timestamp(): a stable bound can be an index condition.
   AND coalesce(last_polled_at, started_at) < now() - make_interval(secs => $1)
 ORDER BY coalesce(last_polled_at, started_at)
 LIMIT $2;

-- reservation_take_stale --
-- Take run reservations older than $1 seconds (their admit died or hangs): $2 limit.
DELETE FROM core_run_reservations
 WHERE run_id IN (
        SELECT run_id FROM core_run_reservations
         WHERE created_at < now() - make_interval(secs => $1)  -- now(): stable, so indexable
         ORDER BY created_at
         LIMIT $2
           FOR UPDATE SKIP LOCKED)
RETURNING *;

-- reservation_put_back --
-- Keep a reservation for the next sweep (Core could not be told to cancel): $1 run id,
-- $2 job id, $3 user, $4 Core run id, $5 thesis, $6 sources.
INSERT INTO core_run_reservations (run_id, job_id, user_id, core_run_id, thesis, sources)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (run_id) DO UPDATE SET core_run_id = EXCLUDED.core_run_id;

-- reservation_release --
-- An admit failed and its held run is cancelled in Core: drop the reservation: $1 run id.
DELETE FROM core_run_reservations WHERE run_id = $1;

-- reservation_set_core_run --
-- An admit failed and Core could not cancel its held run yet: remember the Core id for the
-- sweep: $1 run id, $2 Core run id.
UPDATE core_run_reservations SET core_run_id = $2 WHERE run_id = $1;

-- reservation_orphan --
-- Core did not answer the create: whether it made a held run is unknown. Leave the reservation
-- to the sweep (which re-asks Core and cancels) and free the key for the client's retry: $1 run id.
UPDATE core_run_reservations SET idempotency_key = NULL, request_hash = NULL WHERE run_id = $1;

-- job_event_head --
-- The id of a user's latest event (0 if none): $1 user.
SELECT coalesce((SELECT last_id FROM job_event_counters WHERE user_id = $1), 0) AS last_id;

-- job_event_page --
-- A page of a user's events after an event id, oldest first, each with its job's summary as it
-- is now (NULL if the row is gone) and, when queued, its position: $1 user, $2 after this event
-- id, $3 at most this many events, $4 and about this many bytes of summaries. The first event
-- comes whatever it weighs, so a page always makes progress; ``more`` on every row says whether
-- events after the page may be waiting (the page was cut by count or by bytes).
WITH page AS (
    SELECT e.event_id, e.kind, e.created_at AS event_at, s.*,
           sum(coalesce(s.summary_bytes, 64)) OVER (ORDER BY e.event_id) AS bytes_through,
           coalesce(s.summary_bytes, 64) AS own_bytes
      FROM job_events e
      LEFT JOIN aq_job_summaries_v1 s ON s.id = e.job_id
     WHERE e.user_id = $1 AND e.event_id > $2
     ORDER BY e.event_id
     LIMIT $3)
SELECT page.*, p.queue_position,
       (SELECT count(*) FROM page) = $3
           OR EXISTS (SELECT 1 FROM page c WHERE c.bytes_through - c.own_bytes >= $4) AS more
  FROM page
  LEFT JOIN (SELECT q.id, row_number() OVER (ORDER BY q.queue_seq) AS queue_position
               FROM analysis_jobs q
              WHERE q.user_id = $1 AND q.status = 'queued'
                AND q.delta_of_job_id IS NULL) p ON p.id = page.id
 WHERE page.bytes_through - page.own_bytes < $4
 ORDER BY page.event_id;

-- job_event_prune --
-- Delete events older than $1 seconds, oldest first, at most $2. -> deleted
WITH old AS (
    SELECT user_id, event_id FROM job_events
     WHERE created_at < now() - make_interval(secs => $1)  -- now(): stable, so indexable
     ORDER BY created_at
     LIMIT $2
), gone AS (
    DELETE FROM job_events e USING old
     WHERE e.user_id = old.user_id AND e.event_id = old.event_id
    RETURNING 1
)
SELECT count(*) AS deleted FROM gone;

-- job_queue_positions --
-- Where each of a user's queued first-pass jobs stands (1 = next), in queue order: $1 user.
SELECT q.id, row_number() OVER (ORDER BY q.queue_seq) AS queue_position
  FROM analysis_jobs q
 WHERE q.user_id = $1 AND q.status = 'queued' AND q.delta_of_job_id IS NULL
 ORDER BY q.queue_seq;
