-- A reservation holds its click's credit until the admit debits it (sql/functions/admit.sql,
-- aq_reserve_v2): the hold is the row's cost, so deleting the row releases it, once. A
-- constant default is a catalog change (no table rewrite); rows of the previous release hold
-- nothing, as they always did. The index serves the sum of a user's holds.
-- aq:no-transaction
ALTER TABLE core_run_reservations
    ADD COLUMN IF NOT EXISTS cost integer NOT NULL DEFAULT 0 CHECK (cost >= 0);
CREATE INDEX CONCURRENTLY IF NOT EXISTS core_run_reservations_user
    ON core_run_reservations (user_id);
