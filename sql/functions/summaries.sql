-- summaries: a job without its sources and verdicts, the shape lists and event frames carry
-- (models.JobSummary), so that what they send does not grow with what a job stores. The whole
-- job is GET /v1/analyses/{id} (query job_get).
--
-- A view reads analysis_jobs' columns as they are: a migration that drops or retypes a column
-- it names must drop the view first (it comes back when the repeatables are applied after the
-- numbered migrations). A change of its columns' meaning is a new name (_v2).

CREATE OR REPLACE VIEW aq_job_summaries_v1 AS
SELECT j.id, j.user_id, j.run_id, j.status, j.queue_seq, j.delta_of_job_id, j.deleted_at,
       j.thesis,
       jsonb_array_length(j.sources) AS source_count,
       (SELECT jsonb_object_agg(v.verdict, v.n)
          FROM (SELECT coalesce(e.value ->> 'verdict', 'null') AS verdict, count(*) AS n
                  FROM jsonb_array_elements(j.verdicts) e
                 GROUP BY 1) v) AS verdict_counts,
       j.created_at, j.promoted_at, j.started_at, j.finished_at, j.error_code, j.error_detail,
       j.waiting_for,
       -- What the summary weighs in a frame, about: pages are cut by it (job_event_pages).
       octet_length(j.thesis::text) + coalesce(octet_length(j.error_detail), 0) + 512
           AS summary_bytes
  FROM analysis_jobs j;
