-- Upgrades a PostgreSQL outbox made by postgresql.sql (or the relay) at revision 0001 to 0002,
-- for teams that manage their own schema: what the relay's migration 0002 does
-- (rabbit_retry/outbox/migrations/versions/0002_outbox_xid.py says why). One transaction.
--
-- The column's constant default is recorded in the catalog without rewriting the table: the
-- rows already there read 0 and come first (each of them was committed before: the ALTER TABLE
-- waits for every transaction that added one). Building the two partial indexes reads the
-- whole table while the application's inserts wait: on a large outbox, run it at a quiet time.

BEGIN;
ALTER TABLE rabbit_retry_outbox ADD COLUMN xid XID8 NOT NULL DEFAULT '0';
ALTER TABLE rabbit_retry_outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id();
DROP INDEX ix_rabbit_retry_outbox_waiting;
CREATE INDEX ix_rabbit_retry_outbox_waiting ON rabbit_retry_outbox (xid, id)
    WHERE status IN ('pending', 'failed');
DROP INDEX ix_rabbit_retry_outbox_key;
CREATE INDEX ix_rabbit_retry_outbox_key ON rabbit_retry_outbox (order_key, xid, id)
    WHERE status IN ('pending', 'failed', 'dead') AND order_key IS NOT NULL;
UPDATE rabbit_retry_outbox_version SET version_num = '0002' WHERE version_num = '0001';
COMMIT;
