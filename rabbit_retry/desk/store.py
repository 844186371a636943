"""The desk's store: parked messages, groups, notes, grouping rules, the audit and sessions in
SQLite or PostgreSQL through SQLAlchemy (synchronous; the desk calls it from worker threads).
What operators do to rows (discard, restore, replay) is ``ledger.Ledger``'s, on the same store.

Every write that must hold together is one transaction: a batch of parked copies with their
groups (committed before the broker hears an ack), a note, a rule with its audit entry. Copies
are inserted with ``ON CONFLICT (digest) DO NOTHING``, so a copy consumed twice (a desk killed
between commit and ack, or two desks) is stored once. Several desks may share one PostgreSQL
database: sessions, rules and the key that signs cookies live here, not in a desk's memory.
"""

from __future__ import annotations

import hashlib
import re
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

from rabbit_retry import contract
from rabbit_retry.desk import schema
from rabbit_retry.desk.errors import NotFound
from rabbit_retry.desk.groups import Grouping, Rule, check_rule
from rabbit_retry.desk.records import Parked, generated_message_id
from rabbit_retry.desk.schema import (
    audit,
    desk_meta,
    group_notes,
    grouping_rules,
    groups,
    message_events,
    messages,
    replay_items,
    sessions,
    totals,
)
from rabbit_retry.errors import InputError
from rabbit_retry.settings import shown

DEFAULT_STORE = "sqlite:///rabbit-retry-desk.db"
_MIGRATION_LOCK = 0x7261626269740001  # PostgreSQL advisory lock: one desk migrates at a time
HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")  # NAME=VALUE searches a header
HISTORY_MAX = 200  # rows of one message id shown in its history


def engine_url(url: str) -> sa.URL:
    """The SQLAlchemy URL of a store URL: ``sqlite:///PATH`` or ``postgresql://...`` (psycopg 3)."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise InputError(f"--store: not a store URL: {shown(url)!r} (use sqlite:///PATH or "
                         "postgresql://user:pass@host/db)") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise InputError("--store: an SQLite store needs a file: sqlite:///PATH")
        return parsed.set(drivername="sqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    raise InputError(f"--store: unsupported database {backend!r} in {shown(url)!r} "
                     "(use sqlite:///PATH or postgresql://...)")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which rows an action takes: listed ids, or every row of a group (in the status the
    action acts on)."""

    ids: tuple[int, ...] = ()
    group: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group} if self.group is not None else {"ids": list(self.ids)}

    def where(self) -> sa.ColumnElement[bool]:
        if self.group is not None:
            return messages.c.group_id == self.group
        return messages.c.id.in_(self.ids)

    def takeable(self, status: str = "parked") -> sa.ColumnElement[bool]:
        """The selection's rows an action may take: in ``status``, and held by no replay."""
        return sa.and_(self.where(), messages.c.status == status, ~in_flight())


@dataclass(frozen=True, slots=True)
class Query:
    """A search of stored messages (the page's and ``GET /api/messages``' filters)."""

    queue: str | None = None
    group: str | None = None
    status: str | None = None
    text: str | None = None  # message id, correlation id, header NAME=VALUE, or body text
    since: datetime | None = None
    until: datetime | None = None
    replay: str | None = None  # the rows a replay took
    source: str | None = None
    limit: int = 50
    offset: int = 0


def now() -> datetime:
    return datetime.now(UTC)


def like(text: str) -> str:
    """``%text%`` with LIKE's own wildcards matched literally (escape ``\\``)."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


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
    def tx(self) -> Iterator[Connection]:
        with self.engine.begin() as connection:
            yield connection

    def upsert(self, table: sa.Table) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)

    def insert_ignore(self, table: sa.Table, keys: list[str]) -> Any:
        return self.upsert(table).on_conflict_do_nothing(index_elements=keys)

    def add_totals(self, tx: Connection, kind: str, counts: Counter[str]) -> None:
        """Add ``counts`` (per queue) to the ``kind`` totals, in the caller's transaction."""
        if not counts:
            return
        rows = [{"queue": q, "kind": kind, "count": n} for q, n in sorted(counts.items())]
        stmt = self.upsert(totals)
        tx.execute(stmt.on_conflict_do_update(
            index_elements=["queue", "kind"],
            set_={"count": totals.c["count"] + stmt.excluded["count"]},
        ), rows)

    def meta(self, name: str) -> str | None:
        with self.engine.connect() as c:
            value = c.execute(sa.select(desk_meta.c.value).where(desk_meta.c.name == name)
                              ).scalar_one_or_none()
            return None if value is None else str(value)

    def session_key(self) -> bytes:
        """The key that signs session cookies, the same for every desk on this store."""
        value = self.meta("session_key")
        if value is None:
            raise RuntimeError("the store has no session key (not migrated?)")
        return bytes.fromhex(value)

    # --- ingest ----------------------------------------------------------------------------

    def insert(self, batch: Sequence[Parked], at: datetime | None = None,
               first: Sequence[bool] | None = None) -> int:
        """Store a batch of parked copies in one transaction; returns how many were new.

        A copy alike to the byte to one stored is skipped: the same delivery again (a desk
        stopped between its commit and its ack). ``first`` says which copies the broker
        delivered for the first time: those cannot be stored yet, so one that shares its digest
        is another message alike to the byte (the broker parks a message itself, without a
        ``parked-id``, when a queue is full or a message expires) and is stored too."""
        if not batch:
            return 0
        at = at or now()
        rows = [dict(p.row(), ingested_at=at) for p in batch]
        first_of_group: dict[str, dict[str, Any]] = {}
        for p in batch:  # a group's sample is its first message
            first_of_group.setdefault(p.group, p.group_row())
        group_rows = list(first_of_group.values())
        with self.tx() as tx:
            if first is not None and any(first):
                _set_apart(tx, rows, first)
            tx.execute(self.insert_ignore(groups, ["id"]), group_rows)
            # A plain executemany (RETURNING would make PostgreSQL's driver parse one huge
            # statement per batch); a copy already stored is skipped. The new rows are those
            # of the batch carrying this batch's ingest time.
            tx.execute(self.insert_ignore(messages, ["digest"]), rows)
            m = messages.c
            new = Counter({
                str(queue): int(count) for queue, count in tx.execute(
                    sa.select(m.queue, sa.func.count())
                    .where(m.digest.in_([r["digest"] for r in rows]), m.ingested_at == at)
                    .group_by(m.queue)
                )
            })
            self.add_totals(tx, "ingested", new)
            return sum(new.values())

    # --- grouping ----------------------------------------------------------------------------

    def grouping(self) -> tuple[int, Grouping]:
        """(generation, the rules of that generation): what a parked copy is grouped by now."""
        with self.engine.connect() as c:
            generation = c.execute(sa.select(desk_meta.c.value)
                                   .where(desk_meta.c.name == "grouping")).scalar_one()
            rules = [Rule(r.pattern, r.name, r.queue) for r in
                     c.execute(sa.select(grouping_rules).order_by(grouping_rules.c.id))]
        return int(generation), Grouping(rules)

    def rules(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in
                    c.execute(sa.select(grouping_rules).order_by(grouping_rules.c.id))]

    def add_rule(self, rule: Rule, actor: str) -> dict[str, Any]:
        """A new rule (checked: ``InputError``), its audit entry, and the next generation: the
        stored messages are regrouped by ``regroup``."""
        check_rule(rule)
        with self.tx() as tx:
            created = tx.execute(grouping_rules.insert().values(
                queue=rule.queue, pattern=rule.pattern, name=rule.name, actor=actor, at=now(),
            ).returning(grouping_rules)).one()
            self._rules_changed(tx, actor, "rule", {"added": _rule_json(created._mapping)})
            return dict(created._mapping)

    def remove_rule(self, rule_id: int, actor: str) -> None:
        with self.tx() as tx:
            gone = tx.execute(grouping_rules.delete().where(grouping_rules.c.id == rule_id)
                              .returning(grouping_rules)).first()
            if gone is None:
                raise NotFound(f"no grouping rule {rule_id}")
            self._rules_changed(tx, actor, "rule", {"removed": _rule_json(gone._mapping)})

    def _rules_changed(self, tx: Connection, actor: str, action: str,
                       detail: dict[str, Any]) -> None:
        tx.execute(desk_meta.update().where(desk_meta.c.name == "grouping").values(
            value=sa.cast(sa.cast(desk_meta.c.value, sa.Integer) + 1, sa.Text)))
        tx.execute(audit.insert().values(at=now(), actor=actor, action=action, count=0,
                                         selection={}, state="done", detail=detail))

    def regroup(self, batch: int = 2000) -> int:
        """Group again every row grouped under an older generation of the rules; returns how
        many rows changed group. Rows are read and written a batch at a time; a rule changed
        meanwhile leaves rows for the next call."""
        generation, grouping = self.grouping()
        m = messages.c
        changed = 0
        after = 0
        while True:
            with self.tx() as tx:
                rows = tx.execute(
                    sa.select(m.id, m.queue, m.reason, m.exception_type, m.exception_message,
                              m.group_id)
                    .where(m.grouping < generation, m.id > after).order_by(m.id).limit(batch)
                ).all()
                if not rows:
                    return changed
                after = rows[-1].id
                moved: dict[str, list[int]] = {}
                new_groups: dict[str, dict[str, Any]] = {}
                for row in rows:
                    group, pattern = grouping.group(row.queue, row.reason, row.exception_type,
                                                    row.exception_message)
                    if group != row.group_id:
                        moved.setdefault(group, []).append(row.id)
                        new_groups.setdefault(group, {
                            "id": group, "queue": row.queue, "reason": row.reason,
                            "exception_type": row.exception_type, "pattern": pattern,
                            "sample": row.exception_message})
                if new_groups:
                    tx.execute(self.insert_ignore(groups, ["id"]), list(new_groups.values()))
                for group, ids in moved.items():
                    tx.execute(messages.update().where(m.id.in_(ids)).values(group_id=group))
                    changed += len(ids)
                tx.execute(messages.update()
                           .where(m.id.in_([r.id for r in rows]), m.grouping < generation)
                           .values(grouping=generation))

    # --- reading ---------------------------------------------------------------------------

    def groups(self, queue: str | None = None, status: str = "parked", *, text: str | None = None,
               limit: int = 100, offset: int = 0) -> tuple[int, list[dict[str, Any]]]:
        """(how many groups have messages in ``status``, one page of them, largest first): each
        with its cause, count, first and last parked, and how many notes it has."""
        m = messages.c
        counts = (
            sa.select(m.group_id, sa.func.count().label("count"),
                      sa.func.min(m.parked_at).label("first"),
                      sa.func.max(m.parked_at).label("last"))
            .where(status_is(status))
            .group_by(m.group_id)
        )
        if queue is not None:
            counts = counts.where(m.queue == queue)
        sub = counts.subquery()
        g = groups.c
        where: list[sa.ColumnElement[bool]] = []
        if text:
            pattern = like(text)
            where.append(sa.or_(g.exception_type.like(pattern, escape="\\"),
                                g.pattern.like(pattern, escape="\\"),
                                g.sample.like(pattern, escape="\\"), g.id == text))
        notes = (sa.select(sa.func.count()).select_from(group_notes)
                 .where(group_notes.c.group_id == g.id).scalar_subquery())
        query = (
            sa.select(groups, sub.c["count"], sub.c.first, sub.c.last, notes.label("notes"))
            .join(sub, sub.c.group_id == g.id).where(*where)
            .order_by(sub.c["count"].desc(), g.id).limit(limit).offset(offset)
        )
        total = (sa.select(sa.func.count()).select_from(groups)
                 .join(sub, sub.c.group_id == g.id).where(*where))
        with self.engine.connect() as c:
            return int(c.execute(total).scalar_one()), [_group_json(row) for row in
                                                         c.execute(query)]

    def group(self, group_id: str) -> dict[str, Any] | None:
        """A group's cause and its messages' count per status (whatever their status)."""
        m = messages.c
        with self.engine.connect() as c:
            row = c.execute(sa.select(groups).where(groups.c.id == group_id)).first()
            if row is None:
                return None
            by_status: dict[Any, Any] = dict(c.execute(sa.select(m.status, sa.func.count())
                                       .where(m.group_id == group_id).group_by(m.status)).all())
        return {"id": row.id, "queue": row.queue, "reason": row.reason,
                "exception_type": row.exception_type, "exception_message": row.pattern,
                "sample": row.sample,
                "counts": {str(k): int(v) for k, v in by_status.items()}}

    def _filters(self, q: Query) -> list[sa.ColumnElement[bool]]:
        m = messages.c
        where: list[sa.ColumnElement[bool]] = []
        if q.queue:
            where.append(m.queue == q.queue)
        if q.group:
            where.append(m.group_id == q.group)
        if q.status:
            where.append(status_is(q.status))
        if q.source:
            where.append(m.source == q.source)
        if q.replay:
            where.append(m.replay_id == q.replay)
        if q.since:
            where.append(m.parked_at >= q.since)
        if q.until:
            where.append(m.parked_at < q.until)
        return where

    def _text_filter(self, text: str) -> sa.ColumnElement[bool]:
        m = messages.c
        name, eq, value = text.partition("=")
        if eq and HEADER_NAME.fullmatch(name.strip()):
            header: sa.ColumnElement[bool] = m.headers[name.strip()].as_string() == value.strip()
            return header
        pattern = like(text)
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
        where = self._filters(q)
        if q.text and q.text.strip():
            text = q.text.strip()
            name, eq, _ = text.partition("=")
            if not (eq and HEADER_NAME.fullmatch(name.strip())):
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

    def message(self, row_id: int) -> dict[str, Any] | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(messages).where(messages.c.id == row_id)).first()
            return None if row is None else _shown(c, [dict(row._mapping)])[0]

    def history(self, row_id: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                            list[tuple[int, int]]] | None:
        """A message's history: (its rows, oldest first: every parked copy of its message id;
        the audit entries that touched them; (row id, audit id) of each discard and restore).
        None when there is no such row."""
        m = messages.c
        with self.engine.connect() as c:
            row = c.execute(sa.select(messages).where(m.id == row_id)).first()
            if row is None:
                return None
            # A row without a message id is replayed under one made from it: its copies that
            # park again carry that one.
            key = row.message_id or generated_message_id(row.digest)
            rows = [dict(r._mapping) for r in c.execute(
                sa.select(messages).where(m.message_id == key)
                .order_by(m.parked_at, m.id).limit(HISTORY_MAX))]
            if all(r["id"] != row_id for r in rows):
                rows.append(dict(row._mapping))
                rows.sort(key=lambda r: (r["parked_at"], r["id"]))
            rows = _shown(c, rows)
            ids = [r["id"] for r in rows]
            events = [(int(e.message_id), int(e.audit_id)) for e in c.execute(
                sa.select(message_events).where(message_events.c.message_id.in_(ids))
                .order_by(message_events.c.id))]
            replay_ids = {r["replay_id"] for r in rows if r["replay_id"]}
            audit_ids = {a for _, a in events}
            entries = [dict(e._mapping) for e in c.execute(
                sa.select(audit).where(sa.or_(audit.c.id.in_(audit_ids),
                                              audit.c.replay_id.in_(replay_ids)))
                .order_by(audit.c.id))] if (audit_ids or replay_ids) else []
        return rows, entries, events

    def held(self, queue: str | None = None, limit: int = 100,
             offset: int = 0) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """Ordered keys held by a parked message (``on_park: hold``): ({queue: how many}, one
        page of the holders, by queue then oldest parked first). A parked copy that holds its
        key carries the hold's id (``contract.ORDERED_HOLD``) and the key
        (``contract.ORDERED_KEY``); replaying or discarding it releases the key."""
        m = messages.c
        hold = m.headers[contract.ORDERED_HOLD].as_string()
        key = m.headers[contract.ORDERED_KEY].as_string()
        where: list[sa.ColumnElement[bool]] = [m.status == "parked", hold.is_not(None)]
        if queue is not None:
            where.append(m.queue == queue)
        counts = sa.select(m.queue, sa.func.count()).where(*where).group_by(m.queue)
        page = (sa.select(m.id, m.queue, m.message_id, key.label("key"), hold.label("hold"),
                          m.parked_at, m.reason, m.exception_type, m.exception_message)
                .where(*where).order_by(m.queue, m.parked_at, m.id).limit(limit).offset(offset))
        with self.engine.connect() as c:
            by_queue = {str(q): int(n) for q, n in c.execute(counts)}
            return by_queue, [dict(r._mapping) for r in c.execute(page)]

    def audit(self, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        query = sa.select(audit).order_by(audit.c.id.desc()).limit(limit).offset(offset)
        with self.engine.connect() as c:
            return [dict(row._mapping) for row in c.execute(query)]

    def audit_entry(self, replay_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(audit).where(audit.c.replay_id == replay_id)).first()
            return None if row is None else dict(row._mapping)

    def parked_again(self, replay_ids: Sequence[str]) -> dict[str, int]:
        """How many copies of each replay parked again since (they came back carrying its id)."""
        if not replay_ids:
            return {}
        m = messages.c
        with self.engine.connect() as c:
            return {str(r[0]): int(r[1]) for r in c.execute(
                sa.select(m.replay_of, sa.func.count()).where(m.replay_of.in_(replay_ids))
                .group_by(m.replay_of))}

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

    # --- notes ---------------------------------------------------------------------------------

    def notes(self, group_id: str) -> list[dict[str, Any]]:
        n = group_notes.c
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(
                sa.select(group_notes).where(n.group_id == group_id).order_by(n.at, n.id))]

    def add_note(self, group_id: str, actor: str, text: str) -> dict[str, Any]:
        with self.tx() as tx:
            if tx.execute(sa.select(groups.c.id).where(groups.c.id == group_id)).first() is None:
                raise NotFound(f"no group {group_id}")
            return dict(tx.execute(group_notes.insert().values(
                group_id=group_id, at=now(), actor=actor, text=text,
            ).returning(group_notes)).one()._mapping)

    # --- sessions ------------------------------------------------------------------------------

    def add_session(self, key: str, identity: str, role: str, how: str, credential: str,
                    lifetime: timedelta) -> datetime:
        moment = now()
        with self.tx() as tx:
            tx.execute(sessions.insert().values(id=key, identity=identity, role=role, how=how,
                                                credential=credential, created_at=moment,
                                                expires_at=moment + lifetime))
        return moment + lifetime

    def session(self, key: str) -> dict[str, Any] | None:
        """The live session stored under ``key``; None once it expired or ended."""
        with self.engine.connect() as c:
            row = c.execute(sa.select(sessions).where(sessions.c.id == key,
                                                      sessions.c.expires_at > now())).first()
            return None if row is None else dict(row._mapping)

    def end_session(self, key: str) -> bool:
        with self.tx() as tx:
            return bool(tx.execute(sessions.delete().where(sessions.c.id == key)).rowcount)

    # --- retention -----------------------------------------------------------------------------

    def sweep(self, keep: timedelta) -> int:
        """Delete replayed and discarded rows changed more than ``keep`` ago (audit stays), and
        expired sessions."""
        m = messages.c
        with self.tx() as tx:
            tx.execute(sessions.delete().where(sessions.c.expires_at <= now()))
            old = sa.select(m.id).where(m.status.in_(("replayed", "discarded")),
                                        m.changed_at < now() - keep, ~in_flight())
            tx.execute(message_events.delete().where(message_events.c.message_id.in_(old)))
            return int(tx.execute(messages.delete().where(m.id.in_(old))).rowcount)


def _rule_json(row: Any) -> dict[str, Any]:
    return {"id": row["id"], "queue": row["queue"], "pattern": row["pattern"],
            "name": row["name"]}


def _group_json(row: Any) -> dict[str, Any]:
    return {
        "id": row.id, "queue": row.queue, "reason": row.reason,
        "exception_type": row.exception_type, "exception_message": row.pattern,
        "sample": row.sample, "count": row.count,
        "first_parked_at": _utc(row.first), "last_parked_at": _utc(row.last),
        "notes": int(row.notes),
    }


def in_flight() -> sa.ColumnElement[bool]:
    """A row a replay holds (taken, or published and not yet confirmed)."""
    return sa.exists().where(replay_items.c.message_id == messages.c.id)


def status_is(status: str) -> sa.ColumnElement[bool]:
    """Rows in ``status`` as the desk shows it: ``replaying`` is a row written ``replayed``
    whose copy the broker has not confirmed yet (its replay still holds it)."""
    m = messages.c
    if status == "replaying":
        return sa.and_(m.status == "replayed", in_flight())
    if status == "replayed":
        return sa.and_(m.status == "replayed", ~in_flight())
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


def no_index(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
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



def _set_apart(tx: Connection, rows: list[dict[str, Any]], first: Sequence[bool]) -> None:
    """Give a digest of its own to each first delivery whose digest the store or an earlier
    copy of the batch has (it is another message, alike to the byte)."""
    fresh = [row["digest"] for row, is_first in zip(rows, first, strict=True) if is_first]
    taken = set(tx.execute(sa.select(messages.c.digest)
                           .where(messages.c.digest.in_(fresh))).scalars())
    for row, is_first in zip(rows, first, strict=True):
        digest = row["digest"]
        if is_first and digest in taken:
            row["digest"] = hashlib.sha256(f"{digest}:{uuid.uuid4().hex}".encode()).hexdigest()
        taken.add(digest)
