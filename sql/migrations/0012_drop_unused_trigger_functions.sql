-- 0012_drop_unused_trigger_functions: the first versions of the NOTIFY and event-log trigger
-- functions. Their triggers were replaced by the _v2 functions' two releases ago (migrations
-- 0007 and 0009), so nothing calls them. A database baselined at 0011 never had them.
DROP FUNCTION IF EXISTS aq_job_notify_v1();
DROP FUNCTION IF EXISTS aq_job_event_v1();
