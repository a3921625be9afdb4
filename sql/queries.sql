-- The queue's named queries, loaded once into a dict by store/sqlfiles.py.
-- Each block: a "-- name --" line, a line saying what it does and its parameters, then the SQL.
-- The decisions that need locks are SQL functions (sql/functions/, locks in docs/locking.md);
-- these queries call them or do what needs no lock.

-- reserve --
-- The reservations of a group commit of clicks, each holding its cost (aq_reserve_v2):
-- $1 [{"item", "user_id", "run_id", "job_id", "cost", "thesis", "sources", "idempotency_key",
-- "request_hash"}]. -> per item: outcome, job_id, balance.
SELECT * FROM aq_reserve_v2($1);

-- admit --
-- The admits of a group commit of clicks (aq_admit_v3): $1 [{"item", "job_id", "user_id",
-- "run_id", "core_run_id", "thesis", "sources", "cost", "delta_of", "idempotency_key",
-- "request_hash"}], $2 the instance that releases what they start, $3 its claim lease in
-- seconds. -> per item: its outcome, and when admitted the job's columns and position; on the
-- first admitted item, the others' jobs it started (claimed for $2) and whether a pass must
-- give out capacity.
SELECT r.item, r.outcome, (r.job).*, r.queue_position, r.promoted, r.asks_pass
  FROM aq_admit_v3($1, $2, $3) r;

-- promote --
-- Fill free slots (aq_promote_v4): $1 users whose slot freed (may be empty); $2 at most; $3 the
-- instance that releases what it promotes, $4 its claim lease in seconds. -> the ceiling in
-- force on every row, and the promoted jobs, claimed for $3 (one all-NULL job when none).
SELECT p.ceiling, (p.job).*, NULL::bigint AS queue_position
  FROM aq_promote_v4($1, $2, $3, $4) p;

-- promote_woken --
-- A notification woke these users (aq_promote_woken_v2): $1 users, $2 at most, $3 and $4 the
-- claim as for promote. -> the ceiling in force on every row, and jobs it promoted (promoted
-- true, claimed for $3) or found pending and unreleased (false); one all-NULL job when none.
SELECT w.ceiling, w.promoted, (w.job).*, NULL::bigint AS queue_position
  FROM aq_promote_woken_v2($1, $2, $3, $4) w;

-- finish --
-- Terminal moves and/or soft deletes, refunds, and the fill of what they free (aq_finish_v3):
-- $1 [{"item", "job_id" | "core_run_id", "user_id" (a scope), "status", "from", "delete",
-- "error_code", "error_detail", "verdicts", "ran"}], $2 the instance that releases what they
-- promote, $3 its claim lease in seconds. -> per item: outcome, job, old_status, changed,
-- refunded, promoted (claimed for $2), asks_pass.
SELECT * FROM aq_finish_v3($1, $2, $3);

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
           AND aq_first_pass_v1(a.delta_of_job_id)) AS active,
       (SELECT count(*) FROM analysis_jobs q
         WHERE q.user_id = $1 AND q.status = 'queued'
           AND aq_first_pass_v1(q.delta_of_job_id)) AS queued;

-- credit_grant --
-- Grant credits: $1 user, $2 amount, $3 note. -> balance
SELECT aq_credit_grant_v1($1, $2, $3) AS balance;

-- credit_balance --
-- A user's balance, and what of it the clicks in flight hold (aq_reserve_v2): $1 user.
SELECT coalesce((SELECT balance FROM credit_accounts WHERE user_id = $1), 0) AS balance,
       coalesce((SELECT sum(cost) FROM core_run_reservations WHERE user_id = $1), 0) AS held;

-- job_open_counts --
-- Open jobs by status, for metrics: reads only the partial indexes of open work (queued
-- first-pass jobs, then deltas waiting for capacity).
SELECT 'queued' AS status,
       (SELECT count(*) FROM analysis_jobs
         WHERE status = 'queued' AND aq_first_pass_v1(delta_of_job_id))
     + (SELECT count(*) FROM analysis_jobs
         WHERE status = 'queued' AND waiting_for = 'provider_capacity'
           AND NOT aq_first_pass_v1(delta_of_job_id)) AS n
UNION ALL
SELECT status, count(*) FROM analysis_jobs WHERE status IN ('pending', 'running') GROUP BY status;

-- job_get --
-- One job of one user, with its queue position: $1 job id, $2 user.
SELECT j.*,
       CASE WHEN j.status = 'queued' AND aq_first_pass_v1(j.delta_of_job_id) THEN (
           SELECT count(*) FROM analysis_jobs q
            WHERE q.user_id = j.user_id AND q.status = 'queued' AND q.queue_seq <= j.queue_seq
              AND aq_first_pass_v1(q.delta_of_job_id))
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
                AND aq_first_pass_v1(q.delta_of_job_id)) p ON p.id = page.id
 ORDER BY page.queue_seq DESC;

-- jobs_claim --
-- Claim pending jobs for release, so that only one instance releases each (aq_claim_v1):
-- $1 job ids, $2 instance id, $3 lease seconds. -> the jobs claimed. One statement for every
-- dispatch that asked while the previous one ran.
SELECT c.*, NULL::bigint AS queue_position FROM aq_claim_v1($1::uuid[], $2, $3) c;

-- jobs_mark_running --
-- Core released the runs: $1 job ids, $2 the instance that claimed them (aq_mark_running_v3).
-- -> the ids of the jobs it moved to running (nobody reads more of them: a whole row per job
-- was a twelfth of the service's time in the drain). One commit, and one turn at NOTIFY's
-- commit lock, for every release that completed while the previous one was being written.
SELECT m.job_id FROM aq_mark_running_v3($1::uuid[], $2) m;

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
     WHERE q.status = 'queued' AND aq_first_pass_v1(q.delta_of_job_id)
     ORDER BY q.user_id, q.queue_seq)
SELECT h.user_id
  FROM heads h
 WHERE (h.waiting_for = 'your_previous_analysis' OR (SELECT off FROM settings))
   AND NOT EXISTS (SELECT 1 FROM user_limits l WHERE l.user_id = h.user_id)
   AND NOT EXISTS (
        SELECT 1 FROM analysis_jobs a
         WHERE a.user_id = h.user_id
           AND a.status IN ('pending', 'running')
           AND aq_first_pass_v1(a.delta_of_job_id))
UNION
SELECT l.user_id
  FROM user_limits l
 WHERE (SELECT q.waiting_for = 'your_previous_analysis' OR (SELECT off FROM settings)
          FROM analysis_jobs q
         WHERE q.user_id = l.user_id AND q.status = 'queued'
           AND aq_first_pass_v1(q.delta_of_job_id)
         ORDER BY q.queue_seq
         LIMIT 1)
   AND (SELECT count(*) FROM analysis_jobs a
         WHERE a.user_id = l.user_id
           AND a.status IN ('pending', 'running')
           AND aq_first_pass_v1(a.delta_of_job_id)) < l.max_running
UNION
SELECT d.user_id
  FROM analysis_jobs d
 WHERE d.status = 'queued' AND d.waiting_for = 'provider_capacity'
   AND NOT aq_first_pass_v1(d.delta_of_job_id)
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
-- A click was not admitted (Core refused it, or its admit failed): drop its reservation, which
-- releases its hold: $1 run id. -> the run id when it was still there (waiting for an admit in
-- flight, which deletes it when it commits).
DELETE FROM core_run_reservations WHERE run_id = $1 RETURNING run_id;

-- reservation_release_hold --
-- A click's admit failed, committed or not: if its reservation is still there, no admit will
-- spend its hold, so release it (the user's next click finds the credit) and keep the row: the
-- key stays in progress and the sweep cancels the held run. $1 run id. Waits for an admit still
-- in flight, which deletes the row when it commits.
UPDATE core_run_reservations SET cost = 0 WHERE run_id = $1 AND cost > 0;

-- reservation_orphan --
-- Core did not answer the create: whether it made a held run is unknown. Leave the reservation
-- to the sweep (which re-asks Core and cancels), release its hold, and free the key for the
-- client's retry: $1 run id.
UPDATE core_run_reservations SET idempotency_key = NULL, request_hash = NULL, cost = 0
 WHERE run_id = $1;

-- job_event_head --
-- The id of a user's latest event (0 if none): $1 user.
SELECT coalesce((SELECT last_id FROM job_event_counters WHERE user_id = $1), 0) AS last_id;

-- job_event_pages --
-- A page of each user's events after that user's event id, oldest first, each with its job's
-- summary as it is now (NULL if the row is gone) and, when queued, its position: $1 users,
-- $2 after these event ids (the same order), $3 at most this many events per user, $4 and
-- about this many bytes of summaries per user. A user's first event comes whatever it weighs,
-- so a page always makes progress; ``more`` on every row says whether events after its user's
-- page may be waiting (the page was cut by count or by bytes); ``queued_ids`` on every row, the
-- user's queued first-pass jobs in queue order as this statement sees them (the positions the
-- stream's ``position`` frames report). One statement for all the users an instance's streams
-- are waiting on: the hub reads them together (loops/hub.py).
SELECT f.user_id AS feed_user_id, qa.queued_ids, page.*
  FROM unnest($1::text[], $2::bigint[]) AS f(user_id, after_id)
 CROSS JOIN LATERAL (
    SELECT coalesce(array_agg(q.id ORDER BY q.queue_seq), '{}') AS queued_ids
      FROM analysis_jobs q
     WHERE q.user_id = f.user_id AND q.status = 'queued'
       AND aq_first_pass_v1(q.delta_of_job_id)) qa
 CROSS JOIN LATERAL (
    WITH page AS (
        SELECT e.event_id, e.kind, e.created_at AS event_at, s.*,
               sum(coalesce(s.summary_bytes, 64)) OVER (ORDER BY e.event_id) AS bytes_through,
               coalesce(s.summary_bytes, 64) AS own_bytes
          FROM job_events e
          LEFT JOIN aq_job_summaries_v1 s ON s.id = e.job_id
         WHERE e.user_id = f.user_id AND e.event_id > f.after_id
         ORDER BY e.event_id
         LIMIT $3)
    SELECT page.*, array_position(qa.queued_ids, page.id) AS queue_position,
           (SELECT count(*) FROM page) = $3
               OR EXISTS (SELECT 1 FROM page c WHERE c.bytes_through - c.own_bytes >= $4) AS more
      FROM page
     WHERE page.bytes_through - page.own_bytes < $4) page
 ORDER BY f.user_id, page.event_id;

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
-- Where each queued first-pass job of these users stands in its user's queue (1 = next), by
-- user in queue order: $1 users.
SELECT q.user_id, q.id,
       row_number() OVER (PARTITION BY q.user_id ORDER BY q.queue_seq) AS queue_position
  FROM analysis_jobs q
 WHERE q.user_id = ANY($1::text[]) AND q.status = 'queued' AND aq_first_pass_v1(q.delta_of_job_id)
 ORDER BY q.user_id, q.queue_seq;
