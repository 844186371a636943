"""The desk's store: parked messages, groups, audit and replays in SQLite or PostgreSQL through
SQLAlchemy (synchronous; the desk calls it from worker threads).

Every write that must hold together is one transaction: a batch of parked copies with their
groups (committed before the broker hears an ack), a replay's claim of its rows with its audit
entry, a discard with its audit entry. Several desks may share one PostgreSQL database: a replay
claims its rows by inserting their ids into ``replay_items`` (primary key: the row's id,
``ON CONFLICT DO NOTHING``), a discard takes only parked rows no replay holds (``UPDATE ...
WHERE status = 'parked' AND NOT EXISTS``), so two desks never replay or discard the same row;
copies are inserted with ``ON CONFLICT (digest) DO NOTHING``, so a copy consumed twice (a desk
killed between commit and ack, or two desks) is stored once.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from rabbit_retry.desk import schema
from rabbit_retry.desk.records import Parked
from rabbit_retry.desk.schema import audit, groups, messages, replay_items, replays, totals
from rabbit_retry.errors import InputError
from rabbit_retry.settings import mask

DEFAULT_STORE = "sqlite:///rabbit-retry-desk.db"
_MIGRATION_LOCK = 0x7261626269740001  # PostgreSQL advisory lock: one desk migrates at a time


def engine_url(url: str) -> sa.URL:
    """The SQLAlchemy URL of a store URL: ``sqlite:///PATH`` or ``postgresql://...`` (psycopg 3)."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise InputError(f"--store: not a store URL: {mask(url)!r} (use sqlite:///PATH or "
                         "postgresql://user:pass@host/db)") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise InputError("--store: an SQLite store needs a file: sqlite:///PATH")
        return parsed.set(drivername="sqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    raise InputError(f"--store: unsupported database {backend!r} in {mask(url)!r} "
                     "(use sqlite:///PATH or postgresql://...)")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which rows an action takes: listed ids, or every parked row of a group."""

    ids: tuple[int, ...] = ()
    group: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group} if self.group is not None else {"ids": list(self.ids)}

    def where(self) -> sa.ColumnElement[bool]:
        if self.group is not None:
            return messages.c.group_id == self.group
        return messages.c.id.in_(self.ids)

    def takeable(self) -> sa.ColumnElement[bool]:
        """The selection's rows an action may take: parked, and held by no replay."""
        held = sa.exists().where(replay_items.c.message_id == messages.c.id)
        return sa.and_(self.where(), messages.c.status == "parked", ~held)


@dataclass(frozen=True, slots=True)
class Query:
    """A search of stored messages (the page's and ``GET /api/messages``' filters)."""

    queue: str | None = None
    group: str | None = None
    status: str | None = None
    text: str | None = None  # message id, correlation id, header NAME=VALUE, or body text
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 50
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Claimed:
    """A replay this desk carries out: its id, where to, how fast."""

    id: str
    to_queue: str | None
    rate: float | None


def now() -> datetime:
    return datetime.now(UTC)


class Store:
    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        self.url = url
        target = engine_url(url)
        self.dialect = target.get_backend_name()
        if self.dialect == "sqlite":
            self.engine: Engine = sa.create_engine(
                target, connect_args={"timeout": 30, "check_same_thread": False},
            )
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        else:
            # psycopg's executemany pipelines the rows; SQLAlchemy's "insertmanyvalues" would
            # build one statement with thousands of parameters per batch instead.
            self.engine = sa.create_engine(target, pool_size=pool_size, pool_pre_ping=True,
                                           use_insertmanyvalues=False)

    def close(self) -> None:
        self.engine.dispose()

    # --- schema ----------------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the tables to the newest migration (Alembic); several desks may start at once."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option(
            "script_location", str(resources.files("rabbit_retry.desk") / "migrations")
        )
        with self.engine.begin() as connection:
            if self.dialect == "postgresql":
                connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"),
                                   {"k": _MIGRATION_LOCK})
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as connection:
            yield connection

    # --- ingest ----------------------------------------------------------------------------

    def insert(self, batch: Sequence[Parked], at: datetime | None = None) -> int:
        """Store a batch of parked copies in one transaction; returns how many were new."""
        if not batch:
            return 0
        at = at or now()
        rows = [dict(p.row(), ingested_at=at) for p in batch]
        first_of_group: dict[str, dict[str, Any]] = {}
        for p in batch:  # a group's sample is its first message
            first_of_group.setdefault(p.group, p.group_row())
        group_rows = list(first_of_group.values())
        with self._tx() as tx:
            tx.execute(self._insert_ignore(groups, ["id"]), group_rows)
            # A plain executemany (RETURNING would make PostgreSQL's driver parse one huge
            # statement per batch); a copy already stored is skipped. The new rows are those
            # of the batch carrying this batch's ingest time.
            tx.execute(self._insert_ignore(messages, ["digest"]), rows)
            m = messages.c
            new = Counter({
                str(queue): int(count) for queue, count in tx.execute(
                    sa.select(m.queue, sa.func.count())
                    .where(m.digest.in_([r["digest"] for r in rows]), m.ingested_at == at)
                    .group_by(m.queue)
                )
            })
            self._add(tx, "ingested", new)
            return sum(new.values())

    def _add(self, tx: Connection, kind: str, counts: Counter[str]) -> None:
        """Add ``counts`` (per queue) to the ``kind`` totals, in the caller's transaction."""
        if not counts:
            return
        rows = [{"queue": q, "kind": kind, "count": n} for q, n in sorted(counts.items())]
        stmt = self._upsert(totals)
        tx.execute(stmt.on_conflict_do_update(
            index_elements=["queue", "kind"],
            set_={"count": totals.c["count"] + stmt.excluded["count"]},
        ), rows)

    def _upsert(self, table: sa.Table) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)

    def _insert_ignore(self, table: sa.Table, keys: list[str]) -> Any:
        return self._upsert(table).on_conflict_do_nothing(index_elements=keys)

    # --- reading ---------------------------------------------------------------------------

    def groups(self, queue: str | None = None, status: str = "parked") -> list[dict[str, Any]]:
        """Each group with messages in ``status``: its cause, count, first and last parked."""
        m = messages.c
        counts = (
            sa.select(m.group_id, sa.func.count().label("count"),
                      sa.func.min(m.parked_at).label("first"),
                      sa.func.max(m.parked_at).label("last"))
            .where(_status_is(status))
            .group_by(m.group_id)
        )
        if queue is not None:
            counts = counts.where(m.queue == queue)
        sub = counts.subquery()
        query = (
            sa.select(groups, sub.c["count"], sub.c.first, sub.c.last)
            .join(sub, sub.c.group_id == groups.c.id)
            .order_by(sub.c["count"].desc(), groups.c.id)
        )
        with self.engine.connect() as c:
            return [
                {
                    "id": row.id, "queue": row.queue, "reason": row.reason,
                    "exception_type": row.exception_type, "exception_message": row.pattern,
                    "sample": row.sample, "count": row.count,
                    "first_parked_at": _utc(row.first), "last_parked_at": _utc(row.last),
                }
                for row in c.execute(query)
            ]

    def _filters(self, q: Query) -> list[sa.ColumnElement[bool]]:
        m = messages.c
        where: list[sa.ColumnElement[bool]] = []
        if q.queue:
            where.append(m.queue == q.queue)
        if q.group:
            where.append(m.group_id == q.group)
        if q.status:
            where.append(_status_is(q.status))
        if q.since:
            where.append(m.parked_at >= q.since)
        if q.until:
            where.append(m.parked_at < q.until)
        if q.text:
            where.append(self._text_filter(q.text.strip()))
        return where

    def _text_filter(self, text: str) -> sa.ColumnElement[bool]:
        m = messages.c
        name, eq, value = text.partition("=")
        if eq and name and " " not in name:
            header: sa.ColumnElement[bool] = m.headers[name.strip()].as_string() == value.strip()
            return header
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        return sa.or_(
            m.body_text.like(pattern, escape="\\"),
            m.exception_message.like(pattern, escape="\\"),
        )

    def messages(self, q: Query) -> tuple[int, list[dict[str, Any]]]:
        """(how many match, one page of them, newest parked first).

        A text that is some message's id or correlation id finds those messages alone (two
        index lookups); only a text that is neither is searched for in bodies and exception
        messages, which reads every row the other filters leave."""
        m = messages.c
        where = self._filters(dataclasses.replace(q, text=None))
        if q.text and q.text.strip():
            text = q.text.strip()
            name, eq, _ = text.partition("=")
            if not (eq and name and " " not in name):
                exact = sa.or_(m.message_id == text, m.correlation_id == text)
                with self.engine.connect() as c:
                    found = c.execute(sa.select(m.id).where(exact, *where).limit(1)).first()
                where.append(exact if found is not None else self._text_filter(text))
            else:
                where.append(self._text_filter(text))
        count = sa.select(sa.func.count()).select_from(messages).where(*where)
        page = (
            sa.select(messages).where(*where)
            .order_by(m.parked_at.desc(), m.id.desc()).limit(q.limit).offset(q.offset)
        )
        with self.engine.connect() as c:
            total = int(c.execute(count).scalar_one())
            return total, _shown(c, [dict(row._mapping) for row in c.execute(page)])

    def message(self, message_id: int) -> dict[str, Any] | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(messages).where(messages.c.id == message_id)).first()
            return None if row is None else _shown(c, [dict(row._mapping)])[0]

    def audit(self, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        query = sa.select(audit).order_by(audit.c.id.desc()).limit(limit).offset(offset)
        with self.engine.connect() as c:
            return [dict(row._mapping) for row in c.execute(query)]

    def parked_by(self) -> list[tuple[str, str | None, int, datetime | None]]:
        """(queue, reason, parked count, oldest parked_at) of every queue and reason."""
        m = messages.c
        query = (
            sa.select(m.queue, m.reason, sa.func.count(), sa.func.min(m.parked_at))
            .where(m.status == "parked").group_by(m.queue, m.reason)
        )
        with self.engine.connect() as c:
            return [(r[0], r[1], int(r[2]), _utc(r[3])) for r in c.execute(query)]

    def totals(self) -> list[tuple[str, str, int]]:
        """(queue, ingested | replayed | discarded, count) since the store began."""
        query = sa.select(totals.c.queue, totals.c.kind, totals.c["count"])
        with self.engine.connect() as c:
            return [(r[0], r[1], int(r[2])) for r in c.execute(query)]

    def status_counts(self) -> dict[str, int]:
        m = messages.c
        query = sa.select(m.status, sa.func.count()).group_by(m.status)
        flying = (sa.select(sa.func.count()).select_from(replay_items)
                  .join(messages, m.id == replay_items.c.message_id)
                  .where(m.status == "replayed"))
        with self.engine.connect() as c:
            counts = {str(r[0]): int(r[1]) for r in c.execute(query)}
            replaying = int(c.execute(flying).scalar_one())
        if replaying:
            counts["replaying"] = replaying
            counts["replayed"] -= replaying
            if not counts["replayed"]:
                del counts["replayed"]
        return counts

    # --- actions ---------------------------------------------------------------------------

    def _count_audit(self, tx: Connection, action: str, actor: str, selection: Selection,
                     *, reason: str | None = None, replay_id: str | None = None,
                     to_queue: str | None = None, state: str) -> int:
        result = tx.execute(
            audit.insert().values(
                at=now(), actor=actor, action=action, count=0, selection=selection.to_json(),
                reason=reason, replay_id=replay_id, to_queue=to_queue, state=state,
            )
        )
        key = result.inserted_primary_key
        assert key is not None
        return int(key[0])

    def discard(self, selection: Selection, actor: str, reason: str) -> int:
        """Mark the selection's parked rows discarded, with its audit entry, in one step."""
        with self._tx() as tx:
            entry = self._count_audit(tx, "discard", actor, selection, reason=reason,
                                      state="done")
            per_queue = Counter(tx.execute(
                messages.update()
                .where(selection.takeable())
                .values(status="discarded", changed_at=now(), discard_reason=reason)
                .returning(messages.c.queue)
            ).scalars())
            done = sum(per_queue.values())
            self._add(tx, "discarded", per_queue)
            tx.execute(audit.update().where(audit.c.id == entry)
                       .values(count=done, done_count=done, done_at=now()))
            return done

    def start_replay(self, selection: Selection, actor: str, owner: str, *,
                     to_queue: str | None, rate: float | None, lease: float) -> tuple[str, int]:
        """Take the selection's parked rows for a new replay (``replay_items``: from now on no
        other action takes them) and write its audit entry and lease, in one transaction.
        The rows stay ``parked`` until ``replay_rows`` claims their page. Returns (replay id,
        rows taken)."""
        replay_id = uuid.uuid4().hex
        with self._tx() as tx:
            entry = self._count_audit(tx, "replay", actor, selection, replay_id=replay_id,
                                      to_queue=to_queue, state="pending")
            taken = sa.select(messages.c.id, sa.literal(replay_id, sa.String(32))).where(
                selection.takeable())
            tx.execute(self._insert_ignore(replay_items, ["message_id"])
                       .from_select(["message_id", "replay_id"], taken))
            claimed = tx.execute(  # (an INSERT ... SELECT's rowcount is -1 on psycopg)
                sa.select(sa.func.count()).where(replay_items.c.replay_id == replay_id)
            ).scalar_one()
            tx.execute(audit.update().where(audit.c.id == entry).values(count=claimed))
            tx.execute(replays.insert().values(id=replay_id, to_queue=to_queue, rate=rate,
                                               owner=owner,
                                               lease_until=now() + timedelta(seconds=lease)))
            return replay_id, int(claimed)

    def replay_rows(self, replay_id: str, after: int, limit: int) -> list[dict[str, Any]]:
        """Claim the replay's next rows (up to ``limit`` of its rows, by id after ``after``)
        and return the ones to publish: its parked rows are written ``replayed`` now (their
        one write; they count as ``replaying`` while their ``replay_items`` entry lasts, that
        is until ``settle_replayed``); rows it claimed before (a replay taken over from a desk
        that died) come back as they are. Empty when no row of the replay is left."""
        m, item = messages.c, replay_items.c
        while True:
            with self._tx() as tx:
                ids = list(tx.execute(
                    sa.select(item.message_id)
                    .where(item.replay_id == replay_id, item.message_id > after)
                    .order_by(item.message_id).limit(limit)
                ).scalars())
                if not ids:
                    return []
                # By the list of ids, never a join: with a new table's missing statistics a
                # planner may join the two tables row by row over again. ``_no_index`` keeps
                # it from reading every row in a status through a status index instead.
                to_queue = tx.execute(
                    sa.select(replays.c.to_queue).where(replays.c.id == replay_id)
                ).scalar_one_or_none()
                tx.execute(messages.update()
                           .where(m.id.in_(ids), _no_index(m.status) == "parked")
                           .values(status="replayed", replay_id=replay_id,
                                   replayed_to=to_queue, changed_at=now()))
                query = (
                    sa.select(m.id, m.queue, m.headers_raw, m.properties, m.body_text, m.body)
                    .where(m.id.in_(ids), m.replay_id == replay_id,
                           _no_index(m.status) == "replayed")
                    .order_by(m.id)
                )
                rows = [dict(row._mapping) for row in tx.execute(query)]
            after = ids[-1]
            if rows:
                return rows
            # (a page of rows another desk discarded first: go on)

    def settle_replayed(self, replay_id: str, ids: Sequence[int]) -> None:
        """Rows whose copies the broker confirmed: the replay lets go of them."""
        if ids:
            with self._tx() as tx:
                settled = _let_go(tx, replay_id, ids)
                if settled:
                    per_queue = Counter({str(q): int(n) for q, n in tx.execute(
                        sa.select(messages.c.queue, sa.func.count())
                        .where(messages.c.id.in_(settled)).group_by(messages.c.queue))})
                    self._add(tx, "replayed", per_queue)

    def unclaim(self, replay_id: str, ids: Sequence[int]) -> None:
        """Rows whose copies the broker refused: parked again, untouched."""
        if ids:
            with self._tx() as tx:
                refused = _let_go(tx, replay_id, ids)
                if refused:
                    tx.execute(messages.update()
                               .where(messages.c.id.in_(refused),
                                      messages.c.replay_id == replay_id)
                               .values(status="parked", replay_id=None, replayed_to=None,
                                       changed_at=None))

    def finish_replay(self, replay_id: str, outcome: str | None) -> int:
        """Close a replay: its audit entry says how many were replayed; the lease goes."""
        m = messages.c
        with self._tx() as tx:
            left = tx.execute(
                sa.select(sa.func.count()).select_from(replay_items)
                .join(messages, m.id == replay_items.c.message_id)
                .where(replay_items.c.replay_id == replay_id, m.status == "replayed")
            ).scalar_one()
            if left:
                raise RuntimeError(f"replay {replay_id}: {left} rows still unconfirmed")
            done = int(tx.execute(
                sa.select(sa.func.count()).where(m.replay_id == replay_id, m.status == "replayed")
            ).scalar_one())
            tx.execute(
                audit.update().where(audit.c.replay_id == replay_id)
                .values(state="failed" if outcome else "done", done_count=done, done_at=now(),
                        outcome=outcome)
            )
            tx.execute(replays.delete().where(replays.c.id == replay_id))
            tx.execute(replay_items.delete().where(replay_items.c.replay_id == replay_id))
            return done

    def renew(self, replay_id: str, owner: str, lease: float) -> bool:
        """Extend this desk's lease of a replay; False when it lost it (another desk took it)."""
        with self._tx() as tx:
            return bool(tx.execute(
                replays.update().where(replays.c.id == replay_id, replays.c.owner == owner)
                .values(lease_until=now() + timedelta(seconds=lease))
            ).rowcount)

    def take_abandoned(self, owner: str, lease: float) -> Claimed | None:
        """A replay whose desk stopped renewing its lease (died), now this desk's to finish."""
        with self._tx() as tx:
            row = tx.execute(
                sa.select(replays).where(replays.c.lease_until < now())
                .order_by(replays.c.lease_until).limit(1)
            ).first()
            if row is None:
                return None
            taken = tx.execute(
                replays.update()
                .where(replays.c.id == row.id, replays.c.lease_until == row.lease_until)
                .values(owner=owner, lease_until=now() + timedelta(seconds=lease))
            ).rowcount
            return Claimed(row.id, row.to_queue, row.rate) if taken else None

    def sweep(self, keep: timedelta) -> int:
        """Delete replayed and discarded rows changed more than ``keep`` ago (audit stays)."""
        m = messages.c
        with self._tx() as tx:
            return int(tx.execute(
                messages.delete().where(m.status.in_(("replayed", "discarded")),
                                        m.changed_at < now() - keep, ~_in_flight())
            ).rowcount)


def _let_go(tx: Connection, replay_id: str, ids: Sequence[int]) -> list[int]:
    """The replay's rows among ``ids`` that it held, no longer held (ids it did not hold stay
    out: another desk that took the replay over let go of them first)."""
    return list(tx.execute(
        replay_items.delete()
        .where(replay_items.c.replay_id == replay_id, replay_items.c.message_id.in_(ids))
        .returning(replay_items.c.message_id)
    ).scalars())


def _in_flight() -> sa.ColumnElement[bool]:
    """A row a replay holds (taken, or published and not yet confirmed)."""
    return sa.exists().where(replay_items.c.message_id == messages.c.id)


def _status_is(status: str) -> sa.ColumnElement[bool]:
    """Rows in ``status`` as the desk shows it: ``replaying`` is a row written ``replayed``
    whose copy the broker has not confirmed yet (its replay still holds it)."""
    m = messages.c
    if status == "replaying":
        return sa.and_(m.status == "replayed", _in_flight())
    if status == "replayed":
        return sa.and_(m.status == "replayed", ~_in_flight())
    return m.status == status


def _shown(c: Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the status the desk shows (``replaying`` while a replay holds them)."""
    written = [row["id"] for row in rows if row["status"] == "replayed"]
    if written:
        held = set(c.execute(sa.select(replay_items.c.message_id)
                             .where(replay_items.c.message_id.in_(written))).scalars())
        for row in rows:
            if row["id"] in held:
                row["status"] = "replaying"
    return rows


def _no_index(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``column`` as an expression no index matches (SQLite and PostgreSQL alike)."""
    return sa.func.coalesce(column, "")


def _utc(value: datetime | None) -> datetime | None:
    return schema.UtcDateTime().process_result_value(value, None)  # type: ignore[arg-type]


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    # WAL: the page reads while ingest writes. synchronous=FULL: a commit survives a power loss,
    # since an ack follows it.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
