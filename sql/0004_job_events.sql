-- 0004_job_events: a per-user, gapless, commit-ordered log of job changes for the event stream.
--
-- Event ids are per user and come from the user's counter row, not from a sequence: ids a
-- sequence hands to concurrent transactions are not in commit order, so "everything after
-- id N" could miss a lower id that commits late. The trigger (triggers/0005) increments the
-- counter with an UPDATE, whose row lock is held until commit: a user's event-writing
-- transactions take their ids one after another, each after the previous one committed. A
-- rolled-back transaction rolls its increment back too, so a user's ids are also dense
-- (1, 2, 3, ...), which lets a reader tell "nothing missed" from "pruned".
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
    kind        text NOT NULL CHECK (kind IN
                    ('admitted', 'promoted', 'started', 'finished', 'cancelled', 'deleted',
                     'changed')),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (user_id, event_id)
);

-- Pruning reads the oldest events first. Per user, created_at grows with event_id (it is taken
-- after the counter's row lock was granted), so a prune removes a prefix of each user's log.
CREATE INDEX job_events_created_at ON job_events (created_at);
