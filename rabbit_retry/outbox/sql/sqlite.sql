-- The rabbit-retry outbox's tables on SQLite, for teams that manage their own schema.
--
-- The same tables `rabbit-retry relay` creates with its Alembic migrations, up to revision
-- 0002, and that revision recorded in rabbit_retry_outbox_version (the outbox's own version
-- table, never the application's alembic_version). Run it once on the application's database
-- file; then `rabbit-retry relay --no-migrate` only checks that the schema is the one it needs
-- and never changes it. (Revision 0002 changed the PostgreSQL tables only: a file made from the
-- 0001 script is as good, and the relay takes it as it is.)

CREATE TABLE rabbit_retry_outbox (
    id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    created_at DATETIME NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    exchange TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    message_id TEXT NOT NULL,
    order_key TEXT,
    body BLOB NOT NULL,
    headers BLOB,
    properties TEXT,
    trace TEXT,
    status VARCHAR(16) NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT '0',
    due_at DATETIME,
    last_error TEXT,
    changed_at DATETIME,
    published_at DATETIME
);
CREATE INDEX ix_rabbit_retry_outbox_waiting ON rabbit_retry_outbox (id)
    WHERE status IN ('pending', 'failed');
CREATE INDEX ix_rabbit_retry_outbox_key ON rabbit_retry_outbox (order_key, id)
    WHERE status IN ('pending', 'failed', 'dead') AND order_key IS NOT NULL;
CREATE INDEX ix_rabbit_retry_outbox_held ON rabbit_retry_outbox (order_key, id)
    WHERE status IN ('failed', 'dead') AND order_key IS NOT NULL;
CREATE INDEX ix_rabbit_retry_outbox_published ON rabbit_retry_outbox (published_at)
    WHERE status IN ('published');
CREATE INDEX ix_rabbit_retry_outbox_dead ON rabbit_retry_outbox (status, changed_at)
    WHERE status IN ('dead', 'discarded');
CREATE INDEX ix_rabbit_retry_outbox_message_id ON rabbit_retry_outbox (message_id);

CREATE TABLE rabbit_retry_outbox_history (
    id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    event_id INTEGER NOT NULL,
    at DATETIME NOT NULL,
    status VARCHAR(16) NOT NULL,
    attempt INTEGER,
    detail TEXT,
    actor TEXT
);
CREATE INDEX ix_rabbit_retry_outbox_history_event ON rabbit_retry_outbox_history (event_id, id);

CREATE TABLE rabbit_retry_outbox_lease (
    name VARCHAR(32) NOT NULL PRIMARY KEY,
    owner TEXT NOT NULL,
    until DATETIME NOT NULL
);

CREATE TABLE rabbit_retry_outbox_version (
    version_num VARCHAR(32) NOT NULL,
    CONSTRAINT rabbit_retry_outbox_version_pkc PRIMARY KEY (version_num)
);
INSERT INTO rabbit_retry_outbox_version (version_num) VALUES ('0002');
