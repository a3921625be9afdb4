-- 0015_job_changes_per_statement: job changes are recorded by one statement-level trigger
-- (triggers/job_events.sql: aq_job_changes_v1), which writes the events and the wake-up list of
-- a whole statement at once, in place of two row triggers per change. That file drops the row
-- triggers in the transaction that creates their successor, so no change goes unrecorded.
--
-- This migration changes no table: it marks the release, so that an older instance restarting
-- during the roll, which does not know it, leaves the triggers alone instead of putting its row
-- triggers back beside the statement trigger (every change would then write two events).
COMMENT ON TABLE job_events IS
    'One row per job change, written per statement by aq_job_changes_v1 (triggers/job_events.sql).';
