-- 0006_running_quiet_index: the sweep's "running jobs not heard of lately" reads only those.
--
-- Without it the sweep read every running job's row each pass to evaluate
-- coalesce(last_polled_at, started_at), and those rows lie scattered in a table that grows with
-- history. With it the query is an index range over the quiet ones (usually none).
CREATE INDEX analysis_jobs_running_quiet
    ON analysis_jobs ((coalesce(last_polled_at, started_at)))
    WHERE status = 'running';
