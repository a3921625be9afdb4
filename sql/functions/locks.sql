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

-- A user's lock if it is free now, else false at once: the reservation batch only tries, and
-- aq_lock_users_v1 tries each user before it waits (docs/locking.md).
CREATE OR REPLACE FUNCTION aq_try_lock_user_v1(p_user_id text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(aq_user_lock_key_v1(p_user_id));
END
$$;

-- How long a batch of admits or completions waits, in all, for users' locks held elsewhere
-- before it leaves those users to be decided alone: about one other batch's commit. Longer
-- delays every other click of the batch; shorter sends more clicks to a notifying commit of
-- their own (docs/benchmarks.md).
CREATE OR REPLACE FUNCTION aq_batch_lock_wait_ms_v1() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 50 $$;

-- The user locks of a batch of decisions for many users (admission and completion group
-- commits): in sorted order, each tried, and one that is held elsewhere waited for while the
-- batch's wait budget of p_wait_ms lasts (the holder is usually another batch about to commit).
-- Returns the users it could not lock: their decisions leave the batch and are taken alone. So
-- a batch waits at most p_wait_ms for anyone's lock holder, and, waiting only in sorted order,
-- closes no cycle with the other batches and passes, which lock users in that order too
-- (docs/locking.md, rule 2).
CREATE OR REPLACE FUNCTION aq_lock_users_v1(p_users text[], p_wait_ms integer)
RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_user text;
    v_busy text[] := '{}';
    v_timeout text := current_setting('lock_timeout');
    v_until timestamptz := clock_timestamp() + make_interval(secs => p_wait_ms / 1000.0);
    v_left_ms integer;
BEGIN
    FOR v_user IN SELECT DISTINCT u FROM unnest(p_users) u WHERE u IS NOT NULL ORDER BY u LOOP
        CONTINUE WHEN aq_try_lock_user_v1(v_user);
        v_left_ms := floor(extract(epoch FROM v_until - clock_timestamp()) * 1000);
        IF v_left_ms >= 1 THEN
            PERFORM set_config('lock_timeout', v_left_ms || 'ms', true);
            BEGIN
                PERFORM aq_lock_user_v1(v_user);
                v_left_ms := NULL;  -- locked
            EXCEPTION WHEN lock_not_available THEN
                NULL;
            END;
            PERFORM set_config('lock_timeout', v_timeout, true);
            CONTINUE WHEN v_left_ms IS NULL;
        END IF;
        v_busy := v_busy || v_user;
    END LOOP;
    RETURN v_busy;
END
$$;

-- The global lock guards the provider ceiling's slots and value. Its key text cannot equal a
-- user key (those are the queue's prefix and a colon, then the user id). Its four modes
-- (exclusive or shared, waited for or tried) each have one use: docs/locking.md.
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
