-- 0010_plpgsql_slot_lookup: aq_user_slots_v1 in PL/pgSQL, same signature and result.
--
-- As a LANGUAGE sql function with OUT parameters it is never inlined (only set-returning SQL
-- functions are inlined in FROM), and a non-inlined SQL function is parsed and planned again
-- on every call. It is called by every admit and every completion: in the drain's database
-- work it was the single largest cost (0.32 ms per call, track_functions). PL/pgSQL caches
-- the plan of each statement for the session.

CREATE OR REPLACE FUNCTION aq_user_slots_v1(p_user_id text, OUT max_running integer,
                                            OUT used integer[])
LANGUAGE plpgsql STABLE AS $$
BEGIN
    max_running := coalesce(
        (SELECT l.max_running FROM user_limits l WHERE l.user_id = p_user_id), 1);
    SELECT coalesce(array_agg(a.user_slot), '{}') INTO used
      FROM analysis_jobs a
     WHERE a.user_id = p_user_id AND a.status IN ('pending', 'running')
       AND a.delta_of_job_id IS NULL;
END
$$;
