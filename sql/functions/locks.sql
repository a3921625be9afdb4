-- locks: the queue's advisory locks, the one place their keys are spelled.
--
-- Which operation takes which lock, in what mode and order, and why: docs/locking.md. Read it
-- before changing any function that calls these.
--
-- All are transaction-scoped (released at commit or rollback: no leaked lock after an error)
-- and bounded by lock_timeout (55P03): every function the queries call declares it
-- (SET lock_timeout = '10s'), so the bound holds however the caller connected, a transaction
-- pooler included (docs/locking.md, "The bound"). Each takes its lock in a statement of its
-- own, so under READ COMMITTED the caller's next statement sees everything committed by the
-- lock's previous holder.

-- A user's lock: serializes every decision that fills or frees that user's slots. Old and new
-- versions overlapping in a rolling deploy must agree on the key, so it is spelled only here.
CREATE OR REPLACE FUNCTION aq_user_lock_key_v1(p_user_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('analysis_queue:' || p_user_id, 0)
$$;

CREATE OR REPLACE FUNCTION aq_lock_user_v1(p_user_id text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(aq_user_lock_key_v1(p_user_id));
END
$$;

-- The users' locks, each waited for, in sorted order (docs/locking.md, rule 2): a transaction
-- that waits for several users' locks closes no cycle with another that does the same.
DROP FUNCTION IF EXISTS aq_lock_users_v1(text[], integer);
CREATE OR REPLACE FUNCTION aq_lock_users_v1(p_users text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_user text;
BEGIN
    FOR v_user IN SELECT DISTINCT u FROM unnest(p_users) u WHERE u IS NOT NULL ORDER BY u LOOP
        PERFORM aq_lock_user_v1(v_user);
    END LOOP;
END
$$;

-- The credit holds of users (aq_reserve_v2), sorted: held by the reservations only, so that
-- concurrent clicks of a user see each other's holds, without waiting for the user's lock,
-- which a decision may hold a long time when the jobs table is (docs/locking.md). Taken after
-- any user's lock, and nothing is waited for while it is held.
CREATE OR REPLACE FUNCTION aq_lock_holds_v1(p_users text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_user text;
BEGIN
    FOR v_user IN SELECT DISTINCT u FROM unnest(p_users) u WHERE u IS NOT NULL ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('analysis_queue_holds/' || v_user, 0));
    END LOOP;
END
$$;

-- The locks of a queue decision about p_users (admit, finish, promote): G, the ceiling read
-- under it, then the users' locks, sorted. G is exclusive only for a decision that gives out
-- global slots (p_allocates, with the ceiling on): the users whose ready jobs are next in the
-- fair order for the free slots are locked too, in the same sorted pass, so that the placement
-- can give a slot to whoever's turn it is. Every other decision holds G shared and gives out
-- none: decisions about different users run side by side, and what one leaves to give out
-- asks for a pass (aq_place_locked_v2), as when the ceiling was turned on while it waited
-- (G cannot be upgraded without a deadlock). Returns the ceiling in force, whether the
-- decision allocates, and every user it locked.
DROP FUNCTION IF EXISTS aq_lock_decision_v1(text[], uuid[]);
CREATE OR REPLACE FUNCTION aq_lock_decision_v2(
    p_users text[], p_allocates boolean,
    OUT ceiling integer, OUT allocates boolean, OUT users text[])
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    users := ARRAY(SELECT DISTINCT u FROM unnest(p_users) u WHERE u IS NOT NULL);
    IF aq_ceiling_v2() IS NULL OR NOT p_allocates THEN
        PERFORM aq_lock_global_shared_v1();
        ceiling := aq_ceiling_v2();
        allocates := ceiling IS NULL;
    ELSE
        PERFORM aq_lock_global_v1();
        ceiling := aq_ceiling_v2();  -- after the wait
        allocates := true;
    END IF;
    IF ceiling IS NOT NULL AND allocates THEN
        -- Under G exclusive no slot fills and no job becomes ready but by this transaction.
        users := users || aq_next_in_turn_v1(
            (SELECT ceiling - count(*) FROM analysis_jobs a
              WHERE a.status IN ('pending', 'running'))::integer, users, false);
    END IF;
    users := ARRAY(SELECT DISTINCT u FROM unnest(users) u ORDER BY u);
    PERFORM aq_lock_users_v1(users);
END
$$;

-- The users next in the fair order for p_give global slots (slots.sql, "Fair turns"), one
-- per waiting delta and per user's first ready job: for a holder of G exclusive, to wait for
-- with its own users in the sorted pass (aq_lock_decision_v2); with p_try, for a holder of G
-- shared that hands on the slots its completions freed (aq_finish_v3): each user not in
-- p_held is only tried, and one whose lock another decision holds is passed over (that
-- decision may be placing their jobs; whoever frees a slot later reaches them, or a pass).
-- Trying never waits, so it takes no lock out of order.
CREATE OR REPLACE FUNCTION aq_next_in_turn_v1(p_give integer, p_held text[], p_try boolean)
RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_next record;
    v_give integer := p_give;
    v_counted text[] := '{}';
    v_busy text[] := '{}';
BEGIN
    IF v_give <= 0 THEN
        RETURN v_counted;
    END IF;
    FOR v_next IN
        SELECT q.user_id, NOT aq_first_pass_v1(q.delta_of_job_id) AS delta
          FROM analysis_jobs q
         WHERE q.status = 'queued' AND q.waiting_for = 'provider_capacity'
         ORDER BY q.turn_key, q.queue_seq
    LOOP
        EXIT WHEN v_give <= 0 OR cardinality(v_busy) > 2 * p_give + 8;  -- a bounded walk
        CONTINUE WHEN v_next.user_id = ANY (v_busy)
                   OR (NOT v_next.delta AND v_next.user_id = ANY (v_counted));
        IF p_try AND NOT v_next.user_id = ANY (p_held)
           AND NOT v_next.user_id = ANY (v_counted)
           AND NOT pg_try_advisory_xact_lock(aq_user_lock_key_v1(v_next.user_id)) THEN
            v_busy := v_busy || v_next.user_id;
            CONTINUE;
        END IF;
        v_give := v_give - 1;
        v_counted := v_counted || v_next.user_id;
    END LOOP;
    RETURN v_counted;
END
$$;

-- The global lock G guards the provider ceiling's slots and value. Its key text cannot equal a
-- user key (those are the queue's prefix and a colon, then the user id). Decisions wait for it,
-- shared or exclusive (aq_lock_decision_v2); only the previous release's helpers try it
-- (sql/previous_release/), with the two tries at the end of this file.
CREATE OR REPLACE FUNCTION aq_lock_global_v1() RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

CREATE OR REPLACE FUNCTION aq_lock_global_shared_v1() RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

CREATE OR REPLACE FUNCTION aq_try_lock_global_v1() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(hashtextextended('analysis_queue_ceiling', 0));
END
$$;

CREATE OR REPLACE FUNCTION aq_try_lock_global_shared_v1() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock_shared(hashtextextended('analysis_queue_ceiling', 0));
END
$$;
