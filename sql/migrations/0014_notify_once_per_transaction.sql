-- The NOTIFY of every changed row is replaced by one notification per transaction on a new
-- channel (triggers/job_notify.sql: aq_job_notice_v1 and aq_job_notify_v3). Instances of the
-- previous release listen on aq_jobs_v1, which nothing sends any more: while both run in a
-- rolling deploy, theirs promote on their own commits and their sweep, and their event streams
-- on their 15 s resync, until they are replaced.
DROP TRIGGER IF EXISTS analysis_jobs_notify_insert_v2 ON analysis_jobs;
DROP TRIGGER IF EXISTS analysis_jobs_notify_update_v3 ON analysis_jobs;
DROP FUNCTION IF EXISTS aq_job_notify_v2();
