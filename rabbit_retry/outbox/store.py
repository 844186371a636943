"""The relay's side of the outbox table: claiming events, marking them published or failed, the
SQLite lease, retention, the figures metrics report, and an operator's retry and discard
(SQLAlchemy, synchronous; the relay calls it from worker threads).

A claim is a page of waiting events, oldest first, that no other relay can publish meanwhile:

- Which events, in which order. On PostgreSQL a claim takes only events whose transaction
  (``xid``, the id of the transaction that added the row) is older than every transaction still
  running that may add events (``HORIZON``: each older one has ended, so its rows are all
  visible now, or rolled back for good), in ``(xid, id)`` order. A row that appears later was
  added by a transaction still running then (in the snapshot's ``pg_snapshot_xip``) or not yet
  begun (its id at least the snapshot's xmax): its id is at least the horizon, so it sorts
  after every row taken so far, and no event of a key can turn up ahead of one already
  published. A key's events thus go out in the order their transactions took their ids (at
  their first write), each transaction's in the order it added them.
- Relays' claims are left out of that horizon: a claim's transaction takes an id (its row
  locks) and stays open while its events are published, but adds no event. Each holds the
  shared advisory lock ``CLAIM_MARK`` from its start; ``pg_locks`` (readable by every role)
  shows, in one reading of the lock table, which running transaction ids belong to a
  transaction (a virtual transaction id, never reused) that holds it. Those ids are passed
  over; any other running id (the application's, one not in ``pg_locks`` yet or any more)
  holds the horizon, as ``pg_snapshot_xmin`` alone did. Where ``pg_locks`` cannot be read, the
  store says so once and claims with ``pg_snapshot_xmin``: other relays' claims then hold new
  events back while they publish.
  (Ordering by ``id`` among the rows committed so far, as before revision 0002, published a
  key's later event first whenever its transaction committed while an earlier one was still
  open.) On SQLite one transaction writes at a time: ``id`` order is commit order.

- On PostgreSQL the page is read ``FOR UPDATE SKIP LOCKED`` in a transaction that stays open
  while its events are published and commits their new status: several relays share the work
  and never take one row together, and a relay that dies holds nothing (its transaction rolls
  back, its rows are pending again). A claim keeps the rows of an order key only when it takes
  the key's transaction advisory lock (``pg_try_advisory_xact_lock``) and its rows of the key
  are the key's first waiting events as they stand once it holds the lock: one relay at a time
  has a key, from its first waiting event on, and a relay that finds a key elsewhere leaves
  it out (rather than publish its later events first) and tells the relay, which leaves the
  key out of its next claims for a moment.
- On SQLite one relay at a time publishes: it holds a lease in ``rabbit_retry_outbox_lease``
  that it renews; a second relay waits until the lease runs out. Its claims are plain reads,
  and the relay itself keeps a row or key it has in flight out of its next claim.

In ``hold`` mode (the default) an event of a key that failed (until its next try) or died holds
the key's later events back; in ``continue`` mode they go on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from rabbit_retry.database import create_engine, run_migrations
from rabbit_retry.errors import BrokerError
from rabbit_retry.outbox.decide import RetryPolicy
from rabbit_retry.outbox.names import (
    DEAD,
    DISCARDED,
    FAILED,
    PENDING,
    PUBLISHED,
    TABLE,
    WAITING,
)
from rabbit_retry.outbox.schema import Timestamp, history, lease, outbox, xid_of
from rabbit_retry.settings import mask, shown

log = logging.getLogger("rabbit_retry.outbox")

OnFailure = Literal["hold", "continue"]
HEAD = "0002"  # the newest migration: what this code reads and writes
# Older revisions this code reads and writes as they are, per database: 0002 changed only
# PostgreSQL's tables.
SAME_AS_HEAD = {"sqlite": frozenset({"0001"})}
# pg_try_advisory_xact_lock(class, key): the class keeps our locks apart from the application's.
ADVISORY_CLASS = 0x52524F42
_MIGRATION_LOCK = 0x52524F42_00000001  # pg_advisory_xact_lock: one relay migrates at a time
# pg_advisory_xact_lock_shared: held by every claim's transaction (which adds no event), so that
# other claims do not wait for it (see the module's docstring).
CLAIM_MARK = 0x52524F42_00000002
# The ids (their low 32 bits, as pg_locks shows them) of the running transactions that hold
# CLAIM_MARK: the exclusive lock each transaction holds on its own id, and CLAIM_MARK, by one
# virtual transaction, in one reading of pg_locks (one call of pg_lock_status).
_CLAIMS_XIDS = (
    "SELECT r.xid FROM (SELECT CAST(CAST(l.transactionid AS text) AS bigint) AS xid, "
    "bool_or(l.locktype = 'advisory') OVER (PARTITION BY l.virtualtransaction) AS claim "
    "FROM pg_catalog.pg_locks AS l WHERE l.granted AND ("
    "(l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock') OR "
    f"(l.locktype = 'advisory' AND l.classid = {CLAIM_MARK >> 32} "
    f"AND l.objid = {CLAIM_MARK & 0xFFFFFFFF} AND l.objsubid = 1))) AS r "
    "WHERE r.claim AND r.xid IS NOT NULL")
# The claim's horizon: the oldest id among the statement's snapshot's running transactions that
# are not claims, else the snapshot's xmax (every id below it has ended, or is a claim's). A
# running id is within 2^31 of the others, so its low 32 bits name it.
HORIZON = (
    "(SELECT least(pg_snapshot_xmax(c.s), (SELECT x.x FROM pg_snapshot_xip(c.s) AS x(x) "
    "WHERE CAST(CAST(x.x AS text) AS bigint) % 4294967296 "
    f"NOT IN ({_CLAIMS_XIDS}) ORDER BY x.x LIMIT 1)) "
    "FROM (SELECT pg_current_snapshot() AS s) AS c)")
# Where pg_locks cannot be read: every running transaction holds the horizon, claims too.
PLAIN_HORIZON = "pg_snapshot_xmin(pg_current_snapshot())"
LEASE_NAME = "relay"
SWEEP_BATCH = 5000

_CLAIMED = (outbox.c.id, outbox.c.exchange, outbox.c.routing_key, outbox.c.message_id,
            outbox.c.order_key, outbox.c.body, outbox.c.headers, outbox.c.properties,
            outbox.c.trace, outbox.c.attempts, outbox.c.created_at)


def now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Row:
    """A claimed event, as the relay publishes it."""

    id: int
    exchange: str
    routing_key: str
    message_id: str
    order_key: str | None
    body: bytes
    headers: bytes | None
    properties: str | None
    trace: str | None
    attempts: int
    created_at: datetime


@dataclass
class Claim:
    """A page of events one relay publishes; on PostgreSQL, the open transaction that holds
    them (and their keys) until ``settle`` or ``release``."""

    rows: list[Row]
    connection: Connection | None = None
    transaction: sa.Transaction | None = None
    # PostgreSQL: keys another relay has now; their rows are left out (and stay locked by
    # this claim until it ends, as every row it read).
    elsewhere: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Failure:
    row: Row
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What ``settle`` wrote for a failed event: ``failed`` (tried again at ``due_at``) or
    ``dead``."""

    row: Row
    status: str
    due_at: datetime | None


@dataclass
class Figures:
    """Per destination: events pending, failed and dead now, and the oldest waiting one."""

    pending: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    dead: dict[str, int] = field(default_factory=dict)
    oldest: dict[str, datetime] = field(default_factory=dict)


def destination() -> sa.ColumnElement[str]:
    """``destinations.destination_name`` in SQL."""
    return sa.case((outbox.c.exchange == "", outbox.c.routing_key), else_=outbox.c.exchange)


class OutboxStore:
    def __init__(self, url: str, *, pool_size: int = 8) -> None:
        self.url = url
        self.engine: Engine = create_engine(url, pool_size=pool_size)
        self.dialect = self.engine.dialect.name
        self.locking = self.dialect == "postgresql"
        # PostgreSQL: whether claims can read pg_locks (None: not known yet; see ``horizon``).
        self.sees_claims: bool | None = None

    def close(self) -> None:
        self.engine.dispose()

    # --- schema ----------------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the tables to the newest migration (Alembic, version table of our own);
        several relays may start at once."""
        run_migrations(self.engine, "rabbit_retry.outbox", _MIGRATION_LOCK)

    def revision(self) -> str | None:
        """The outbox schema's revision in the database; None when it has none."""
        from alembic.runtime.migration import MigrationContext

        from rabbit_retry.outbox.names import VERSION_TABLE

        with self.engine.connect() as connection:
            context = MigrationContext.configure(connection,
                                                 opts={"version_table": VERSION_TABLE})
            return context.get_current_revision()

    def up_to_date(self, found: str | None) -> bool:
        """Whether the revision ``found`` is one this code reads and writes on this database."""
        return found == HEAD or found in SAME_AS_HEAD.get(self.dialect, ())

    def check_schema(self) -> None:
        """For ``--no-migrate``: the schema must be the one this code needs, as it is."""
        found = self.revision()
        if not self.up_to_date(found):
            state = "no outbox tables" if found is None else f"revision {found}"
            raise BrokerError(
                f"store {shown(self.url)}: has {state}; this relay needs revision {HEAD} "
                "(apply rabbit_retry/outbox/sql/*.sql, or start the relay without --no-migrate "
                "to migrate it)")

    # --- claiming and settling ---------------------------------------------------------------

    def claim(self, limit: int, *, on_failure: OnFailure = "hold", at: datetime | None = None,
              busy_ids: Iterable[int] = (), busy_keys: Iterable[str] = ()) -> Claim:
        """Up to ``limit`` waiting events, oldest first (PostgreSQL: in ``(xid, id)`` order,
        only those whose transaction is older than any still running; see the module's
        docstring), that this relay may publish now.

        ``busy_keys`` are keys to leave out (this relay has them in flight, or another relay had
        them a moment ago); ``busy_ids`` (SQLite) rows this relay has in flight."""
        at = at or now()
        o, earlier = outbox, outbox.alias("earlier")
        waiting = sa.and_(status_in(o.c.status, WAITING),
                          sa.or_(status_in(o.c.status, (PENDING,)), o.c.due_at <= at))
        # A key's order: ``id`` on SQLite, ``(xid, id)`` on PostgreSQL.
        order: list[sa.ColumnElement[Any]] = [o.c.id]
        before: sa.ColumnElement[bool] = earlier.c.id < o.c.id
        if self.locking:
            order = [xid_of(o), o.c.id]
            before = sa.tuple_(xid_of(earlier), earlier.c.id) < sa.tuple_(xid_of(o), o.c.id)
            # Only rows whose transaction is older than every one still running that may add
            # rows (its rows are all there, or rolled back), in this statement's own snapshot:
            # ``HORIZON``, computed once. The index on (xid, id) reads them in order and stops
            # at the limit.
            waiting = sa.and_(waiting, xid_of(o) < sa.literal_column(self.horizon()))
        keys = sorted(set(busy_keys))
        keyed: sa.ColumnElement[bool] = o.c.order_key.not_in(keys) if keys else sa.true()
        if on_failure == "hold":
            # A key whose earlier event failed (until its next try) or died is held.
            keyed = sa.and_(keyed, ~sa.exists().where(
                earlier.c.order_key == o.c.order_key, before,
                status_in(earlier.c.status, (FAILED, DEAD)),
                sa.or_(status_in(earlier.c.status, (DEAD,)),
                       sa.and_(status_in(earlier.c.status, (FAILED,)),
                               earlier.c.due_at > at))))
        query = (sa.select(*_CLAIMED).where(waiting, sa.or_(o.c.order_key.is_(None), keyed))
                 .order_by(*order).limit(limit))
        if not self.locking:
            ids = sorted(set(busy_ids))
            if ids:
                query = query.where(o.c.id.not_in(ids))
            with self.engine.connect() as connection:
                return Claim([Row(*r) for r in connection.execute(query)])
        connection = self.engine.connect()
        try:
            transaction = connection.begin()
            # Before the row locks give this transaction an id: other claims pass it over.
            connection.execute(sa.text("SELECT pg_advisory_xact_lock_shared(:mark)"),
                               {"mark": CLAIM_MARK})
            rows = [Row(*r) for r in connection.execute(
                query.with_for_update(skip_locked=True, of=o))]
            others = self._keys_of_others(connection, rows, on_failure, at)
        except BaseException:
            connection.close()
            raise
        rows = [r for r in rows if r.order_key not in others]
        if not rows:
            transaction.rollback()
            connection.close()
            return Claim([], elsewhere=others)
        return Claim(rows, connection, transaction, elsewhere=others)

    def horizon(self) -> str:
        """PostgreSQL: the SQL of the claims' horizon: ``HORIZON``, or ``PLAIN_HORIZON`` where
        this store's role cannot read ``pg_locks`` (looked at once, at the first claim; said in
        the log)."""
        if self.sees_claims is None:
            try:
                with self.engine.connect() as connection:
                    connection.execute(sa.text(f"SELECT {HORIZON}")).scalar_one()
                self.sees_claims = True
            except sa.exc.ProgrammingError as exc:  # permission denied, for one
                log.warning("relay: cannot read pg_locks in %s (%s); an event added while "
                            "another relay's claim is open waits for that claim to end",
                            shown(self.url), _first_line(exc))
                self.sees_claims = False
        return HORIZON if self.sees_claims else PLAIN_HORIZON

    def _keys_of_others(self, connection: Connection, rows: list[Row], on_failure: OnFailure,
                        at: datetime) -> set[str]:
        """PostgreSQL: the order keys of ``rows`` this claim may not publish. A key is this
        claim's when it takes the key's advisory lock and its rows of the key are the key's
        first waiting events, in ``(xid, id)`` order, as they stand now (read after the lock:
        another relay may just have published some, or hold some without the key). Rows
        committed since the claim's scan sort after its rows (see ``claim``)."""
        taken: dict[str, list[int]] = {}
        for row in rows:
            if row.order_key is not None:
                taken.setdefault(row.order_key, []).append(row.id)
        if not taken:
            return set()
        mine = set(connection.execute(
            sa.text("SELECT k FROM unnest(CAST(:keys AS text[])) AS k "
                    "WHERE pg_try_advisory_xact_lock(:class, hashtext(k))"),
            {"keys": sorted(taken), "class": ADVISORY_CLASS}).scalars())
        # In hold mode a key's failed (not yet due) or dead event comes first and is not taken;
        # in continue mode those are passed over.
        statuses = ("status IN ('pending', 'failed', 'dead')" if on_failure == "hold" else
                    "(status = 'pending' OR (status = 'failed' AND due_at <= :at))")
        firsts: dict[str, list[int]] = {}
        if mine:
            for key, event_id in connection.execute(sa.text(
                    "SELECT k, e.id FROM unnest(CAST(:keys AS text[])) AS k CROSS JOIN LATERAL "
                    f"(SELECT xid, id FROM {TABLE} WHERE order_key = k AND {statuses} "
                    "ORDER BY xid, id LIMIT :n) AS e ORDER BY k, e.xid, e.id"),
                    {"keys": sorted(mine), "n": max(len(ids) for ids in taken.values()),
                     "at": at}):
                firsts.setdefault(key, []).append(event_id)
        return {key for key, ids in taken.items()
                if key not in mine or firsts.get(key, [])[:len(ids)] != ids}

    def settle(self, claim: Claim, published: Sequence[Row], failed: Sequence[Failure],
               policy: RetryPolicy, actor: str, at: datetime | None = None) -> list[Outcome]:
        """Write what the broker said of a claim's events, in one transaction: ``published``
        confirmed, ``failed`` refused (``failed`` again later, or ``dead``), each failure in the
        history. Events of the claim in neither list are left as they were (on PostgreSQL
        released with the claim's locks)."""
        at = at or now()
        outcomes = []
        for failure in failed:
            status, delay = policy.after_failure(failure.row.attempts + 1)
            due = None if delay is None else at + timedelta(seconds=delay)
            outcomes.append(Outcome(failure.row, status, due))
        try:
            if claim.connection is not None:
                assert claim.transaction is not None
                self._write(claim.connection, published, failed, outcomes, actor, at)
                claim.transaction.commit()
            elif published or failed:
                with self.engine.begin() as connection:
                    self._write(connection, published, failed, outcomes, actor, at)
        finally:
            self.release(claim)
        return outcomes

    def _write(self, tx: Connection, published: Sequence[Row], failed: Sequence[Failure],
               outcomes: Sequence[Outcome], actor: str, at: datetime) -> None:
        o = outbox.c
        if published:
            tx.execute(outbox.update()
                       .where(o.id.in_([r.id for r in published]), o.status.in_(WAITING))
                       .values(status=PUBLISHED, published_at=at, attempts=o.attempts + 1))
        if not failed:
            return
        tx.execute(
            # (no IN in an executemany: SQLAlchemy expands IN lists per statement)
            outbox.update()
            .where(o.id == sa.bindparam("row"), sa.or_(o.status == PENDING, o.status == FAILED))
            .values(status=sa.bindparam("new_status"), attempts=o.attempts + 1,
                    due_at=sa.bindparam("due", type_=Timestamp),
                    last_error=sa.bindparam("error"), changed_at=at),
            [{"row": f.row.id, "new_status": out.status, "due": out.due_at, "error": f.reason}
             for f, out in zip(failed, outcomes, strict=True)],
        )
        entries = []
        for f, out in zip(failed, outcomes, strict=True):
            entries.append({"event_id": f.row.id, "at": at, "status": FAILED,
                            "attempt": f.row.attempts + 1, "detail": f.reason, "actor": actor})
            if out.status == DEAD:
                entries.append({"event_id": f.row.id, "at": at, "status": DEAD,
                                "attempt": f.row.attempts + 1,
                                "detail": f"failed {f.row.attempts + 1} times", "actor": actor})
        tx.execute(history.insert(), entries)

    def release(self, claim: Claim) -> None:
        """Let go of a claim without writing anything (PostgreSQL: its locks)."""
        if claim.connection is not None:
            try:
                if claim.transaction is not None and claim.transaction.is_active:
                    claim.transaction.rollback()
            finally:
                claim.connection.close()
                claim.connection = claim.transaction = None

    # --- the SQLite lease --------------------------------------------------------------------

    def take_lease(self, owner: str, seconds: float, at: datetime | None = None) -> bool:
        """Take or renew the one relay's lease; False while another relay holds it."""
        at = at or now()
        until = at + timedelta(seconds=seconds)
        with self.engine.begin() as tx:
            row = tx.execute(sa.select(lease).where(lease.c.name == LEASE_NAME)).first()
            if row is None:
                try:
                    with tx.begin_nested():
                        tx.execute(lease.insert().values(name=LEASE_NAME, owner=owner,
                                                         until=until))
                except sa.exc.IntegrityError:
                    return False
                return True
            if row.owner != owner and row.until > at:
                return False
            return bool(tx.execute(
                lease.update().where(lease.c.name == LEASE_NAME, lease.c.owner == row.owner,
                                     lease.c.until == row.until)
                .values(owner=owner, until=until)).rowcount)

    def drop_lease(self, owner: str) -> None:
        with self.engine.begin() as tx:
            tx.execute(lease.delete().where(lease.c.name == LEASE_NAME, lease.c.owner == owner))

    # --- retention and figures ---------------------------------------------------------------

    def sweep(self, keep: timedelta, at: datetime | None = None) -> int:
        """Delete events published (or discarded) more than ``keep`` ago, and their history, a
        few thousand per transaction; returns how many."""
        cutoff = (at or now()) - keep
        o = outbox.c
        removed = 0
        for old in (sa.and_(status_in(o.status, (PUBLISHED,)), o.published_at < cutoff),
                    sa.and_(status_in(o.status, (DEAD, DISCARDED)),
                            status_in(o.status, (DISCARDED,)), o.changed_at < cutoff)):
            page = sa.select(o.id).where(old).limit(SWEEP_BATCH).scalar_subquery()
            while True:
                with self.engine.begin() as tx:
                    ids = list(tx.execute(outbox.delete().where(o.id.in_(page))
                                          .returning(o.id)).scalars())
                    if ids:
                        tx.execute(history.delete().where(history.c.event_id.in_(ids)))
                removed += len(ids)
                if len(ids) < SWEEP_BATCH:
                    break
        return removed

    def figures(self) -> Figures:
        """Events pending, failed and dead per destination, and each one's oldest waiting
        event (read at each scrape of the relay's ``/metrics``)."""
        o = outbox.c
        where = destination()
        out = Figures()
        # Waiting and dead rows through their two indexes: never a scan of the published.
        with self.engine.connect() as connection:
            for statuses in (WAITING, (DEAD, DISCARDED)):
                query = (sa.select(where, o.status, sa.func.count(), sa.func.min(o.created_at))
                         .where(status_in(o.status, statuses)).group_by(where, o.status))
                for name, status, count, oldest in connection.execute(query):
                    if status == DISCARDED:
                        continue
                    getattr(out, status)[name] = int(count)
                    if status in WAITING and oldest is not None:
                        first = _aware(oldest)
                        if name not in out.oldest or first < out.oldest[name]:
                            out.oldest[name] = first
        return out

    # --- an operator's view and actions (the failure desk) -----------------------------------

    def events(self, *, status: str | Sequence[str] = DEAD, destination_name: str | None = None,
               text: str | None = None, limit: int = 50,
               offset: int = 0) -> tuple[int, list[dict[str, Any]]]:
        """(how many match, one page of them, newest change first): events in ``status`` (one
        or several), of one destination, or whose message id or order key is ``text``."""
        o = outbox.c
        statuses = (status,) if isinstance(status, str) else tuple(status)
        where: list[sa.ColumnElement[bool]] = [status_in(o.status, statuses)]
        if set(statuses) <= {DEAD, DISCARDED}:  # the index of those two (see ``status_in``)
            where.append(status_in(o.status, (DEAD, DISCARDED)))
        if destination_name is not None:
            where.append(destination() == destination_name)
        if text:
            where.append(sa.or_(o.message_id == text, o.order_key == text))
        count = sa.select(sa.func.count()).select_from(outbox).where(*where)
        page = (sa.select(outbox).where(*where)
                .order_by(o.changed_at.desc(), o.id.desc()).limit(limit).offset(offset))
        with self.engine.connect() as connection:
            total = int(connection.execute(count).scalar_one())
            return total, [dict(r._mapping) for r in connection.execute(page)]

    def event(self, event_id: int) -> dict[str, Any] | None:
        """One event, with its history: added, every failure, operators' actions, published."""
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(outbox).where(outbox.c.id == event_id)).first()
            if row is None:
                return None
            found = dict(row._mapping)
            entries = connection.execute(sa.select(history).where(history.c.event_id == event_id)
                                         .order_by(history.c.id))
            found["history"] = timeline(found, [dict(e._mapping) for e in entries])
            return found

    def retry(self, ids: Sequence[int], actor: str, at: datetime | None = None) -> list[int]:
        """Dead (or failed) events back to ``pending``, with a fresh count of attempts; returns
        the ids it took (an id that is neither is left alone)."""
        at = at or now()
        with self.engine.begin() as tx:
            taken = list(tx.execute(
                outbox.update().where(outbox.c.id.in_(list(ids)),
                                      outbox.c.status.in_((DEAD, FAILED)))
                .values(status=PENDING, attempts=0, due_at=None, changed_at=at)
                .returning(outbox.c.id)).scalars())
            if taken:
                tx.execute(history.insert(), [
                    {"event_id": i, "at": at, "status": PENDING, "detail": "retried",
                     "actor": actor} for i in taken])
            return taken

    def discard(self, ids: Sequence[int], actor: str, reason: str,
                at: datetime | None = None) -> list[int]:
        """Dead (or failed) events never to be published; returns the ids it took."""
        at = at or now()
        with self.engine.begin() as tx:
            taken = list(tx.execute(
                outbox.update().where(outbox.c.id.in_(list(ids)),
                                      outbox.c.status.in_((DEAD, FAILED)))
                .values(status=DISCARDED, due_at=None, changed_at=at)
                .returning(outbox.c.id)).scalars())
            if taken:
                tx.execute(history.insert(), [
                    {"event_id": i, "at": at, "status": DISCARDED, "detail": reason,
                     "actor": actor} for i in taken])
            return taken


def status_in(column: sa.ColumnElement[str], statuses: Sequence[str]) -> sa.ColumnElement[bool]:
    """``column IN ('a', 'b')`` with the statuses written out, never bound: SQLite uses a
    partial index only for a query whose condition repeats the index's own (a bound parameter
    says nothing about its value), and neither does a generic plan on PostgreSQL."""
    return column.in_([sa.literal_column(f"'{status}'") for status in statuses])


def timeline(row: dict[str, Any], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An event's status history: ``pending`` when added, the history table's entries, and
    ``published`` when confirmed (the row itself carries the first and the last)."""
    out = [{"at": _aware(row["created_at"]), "status": PENDING, "attempt": None,
            "detail": "added", "actor": None}]
    out += [{k: e[k] for k in ("at", "status", "attempt", "detail", "actor")} for e in entries]
    if row.get("published_at") is not None:
        out.append({"at": _aware(row["published_at"]), "status": PUBLISHED,
                    "attempt": row["attempts"], "detail": None, "actor": None})
    return out


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _first_line(exc: BaseException) -> str:
    return mask((str(exc).strip().splitlines() or [type(exc).__name__])[0])
