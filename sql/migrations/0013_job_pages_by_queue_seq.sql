-- A user's jobs in pages, newest first (query job_list_page): a keyset on queue_seq, so an
-- index on (user_id, queue_seq DESC) of the jobs not deleted reads a page and stops. The index
-- it replaces ordered by created_at, which no query has used since listings follow queue_seq.
-- aq:no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS analysis_jobs_user_pages
    ON analysis_jobs (user_id, queue_seq DESC) WHERE deleted_at IS NULL;
DROP INDEX CONCURRENTLY IF EXISTS analysis_jobs_user_listing;
