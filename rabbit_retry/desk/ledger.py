"""What operators do to stored rows, as the store records it: discard, restore, and a replay's
life (taken, claimed a few rows at a time, settled as the broker confirms, finished, cancelled,
taken over from a desk that died). Each step is one transaction with its audit entry.

A replay takes its rows in the transaction that writes its audit entry (``replay_items``: no
other action takes them from then on; ``ON CONFLICT DO NOTHING`` lets two desks on one database
race safely). It then *claims* them a few at a time (``parked -> replayed``) just before
publishing their copies, and *settles* each once the broker confirmed it (its ``replay_items``
entry goes), the settling of one batch and the claim of the next in one transaction
(``step``). A row claimed and not settled is one whose copy may be out: when a desk dies, the
desk that takes its replay over re-sends exactly those, counts them in the audit (``resent``:
at most the dead desk's window) and goes on.

An action that selects nothing it may act on raises ``Nothing`` (or ``NotFound``) and writes
nothing, the audit entry included.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from rabbit_retry import contract, wire
from rabbit_retry.desk.errors import NotFound, Nothing
from rabbit_retry.desk.records import stored_headers
from rabbit_retry.desk.schema import audit, groups, message_events, messages, replay_items, replays
from rabbit_retry.desk.store import Selection, Store, no_index, now
from rabbit_retry.parking.message import jsonable

EVENTS_BATCH = 5000


@dataclass(frozen=True, slots=True)
class Claimed:
    """A replay this desk carries out: its id, where to, how fast, an edit's body and headers,
    and (taken over from a desk that died) how many of its copies may have gone out already."""

    id: str
    to_queue: str | None
    rate: float | None
    edit_body: bytes | None = None
    edit_headers: bytes | None = None
    resent: int = 0


@dataclass(frozen=True, slots=True)
class Claim:
    """The rows a replay claimed to publish now, or why it claims no more."""

    rows: list[dict[str, Any]]
    cancel_by: str | None = None


class Ledger:
    def __init__(self, store: Store) -> None:
        self.store = store

    # --- the audit -----------------------------------------------------------------------------

    def _audit(self, tx: Connection, action: str, actor: str, selection: Selection | None,
               **values: Any) -> int:
        return self._audit_json(tx, action, actor,
                                selection.to_json() if selection is not None else {}, **values)

    def _audit_json(self, tx: Connection, action: str, actor: str, selection: dict[str, Any],
                    **values: Any) -> int:
        values.setdefault("state", "done")
        values.setdefault("count", 0)
        key = tx.execute(audit.insert().values(
            at=now(), actor=actor, action=action, selection=selection, **values,
        )).inserted_primary_key
        assert key is not None
        return int(key[0])

    def record(self, action: str, actor: str, selection: dict[str, Any], count: int,
               reason: str | None) -> int:
        """An action done elsewhere (an outbox's retry or discard, in the application's
        database), in the audit: who, what, when, how many."""
        with self.store.tx() as tx:
            return self._audit_json(tx, action, actor, selection, reason=reason, count=count,
                                    done_count=count, done_at=now())

    def _events(self, tx: Connection, entry: int, ids: Sequence[int]) -> None:
        for at in range(0, len(ids), EVENTS_BATCH):
            tx.execute(message_events.insert(),
                       [{"message_id": i, "audit_id": entry} for i in ids[at:at + EVENTS_BATCH]])

    def _nothing(self, tx: Connection, selection: Selection, status: str, verb: str) -> Exception:
        """Why ``selection`` holds nothing in ``status`` to ``verb``: one line."""
        m = messages.c
        if selection.group is not None:
            if tx.execute(sa.select(groups.c.id).where(groups.c.id == selection.group)
                          ).first() is None:
                return NotFound(f"no group {selection.group}")
            return Nothing(f"nothing to {verb}: group {selection.group} has no {status} "
                           "messages (or a replay holds them)")
        found = Counter(
            "replaying" if held else str(state) for state, held in tx.execute(
                sa.select(m.status, sa.exists().where(replay_items.c.message_id == m.id))
                .where(m.id.in_(selection.ids))))
        missing = len(set(selection.ids)) - sum(found.values())
        if not found:
            if len(selection.ids) == 1:
                return NotFound(f"no message {selection.ids[0]}")
            return NotFound(f"none of the {len(set(selection.ids))} messages exists")
        parts = [f"{n} {'is' if n == 1 else 'are'} {state}" for state, n in sorted(found.items())]
        if missing:
            parts.append(f"{missing} {'does' if missing == 1 else 'do'} not exist")
        if len(selection.ids) == 1:
            return Nothing(f"nothing to {verb}: message {selection.ids[0]} is "
                           f"{next(iter(found))}, not {status}")
        return Nothing(f"nothing to {verb}: none of the {len(set(selection.ids))} messages is "
                       f"{status} ({', '.join(parts)})")

    # --- discard and restore -------------------------------------------------------------------

    def discard(self, selection: Selection, actor: str, reason: str) -> int:
        """Mark the selection's parked rows discarded, with its audit entry, in one step."""
        return self._move(selection, actor, "discard", "parked", "discarded", reason,
                          {"discard_reason": reason, "changed_at": now()})

    def restore(self, selection: Selection, actor: str, reason: str | None) -> int:
        """Park the selection's discarded rows again (they are kept until ``--keep`` ends)."""
        return self._move(selection, actor, "restore", "discarded", "parked", reason,
                          {"discard_reason": None, "changed_at": None})

    def _move(self, selection: Selection, actor: str, action: str, old: str, new: str,
              reason: str | None, values: dict[str, Any]) -> int:
        with self.store.tx() as tx:
            entry = self._audit(tx, action, actor, selection, reason=reason)
            moved = tx.execute(
                messages.update().where(selection.takeable(old))
                .values(status=new, **values).returning(messages.c.id, messages.c.queue)
            ).all()
            if not moved:
                raise self._nothing(tx, selection, old, action)
            self._events(tx, entry, [row.id for row in moved])
            if action == "discard":
                # A parked copy that holds its ordered key: the key's later messages wait for
                # it; discarded, it lets them go (``Actions.send_releases``).
                holds = messages.c.headers[contract.ORDERED_HOLD].as_string()
                tx.execute(messages.update()
                           .where(messages.c.id.in_([row.id for row in moved]),
                                  holds.is_not(None))
                           .values(release_pending=True))
            else:
                _hold_again_or_let_go(tx, [row.id for row in moved])
            kind = "discarded" if action == "discard" else "restored"
            self.store.add_totals(tx, kind, Counter(str(row.queue) for row in moved))
            tx.execute(audit.update().where(audit.c.id == entry)
                       .values(count=len(moved), done_count=len(moved), done_at=now()))
            return len(moved)

    # --- a replay's life -----------------------------------------------------------------------

    def start_replay(self, selection: Selection, actor: str, owner: str, *,
                     to_queue: str | None, rate: float | None, lease: float) -> tuple[str, int]:
        """Take the selection's parked rows for a new replay (``replay_items``: from now on no
        other action takes them) and write its audit entry and lease, in one transaction.
        Returns (replay id, rows taken)."""
        replay_id = uuid.uuid4().hex
        with self.store.tx() as tx:
            entry = self._audit(tx, "replay", actor, selection, replay_id=replay_id,
                                to_queue=to_queue, state="running", done_count=0, refused=0)
            taken = sa.select(messages.c.id, sa.literal(replay_id, sa.String(32))).where(
                selection.takeable())
            tx.execute(self.store.insert_ignore(replay_items, ["message_id"])
                       .from_select(["message_id", "replay_id"], taken))
            count = int(tx.execute(  # (an INSERT ... SELECT's rowcount is -1 on psycopg)
                sa.select(sa.func.count()).where(replay_items.c.replay_id == replay_id)
            ).scalar_one())
            if not count:
                raise self._nothing(tx, selection, "parked", "replay")
            queues = sorted(str(q) for q in tx.execute(
                sa.select(messages.c.queue).distinct()
                .join(replay_items, replay_items.c.message_id == messages.c.id)
                .where(replay_items.c.replay_id == replay_id)).scalars())
            tx.execute(audit.update().where(audit.c.id == entry)
                       .values(count=count, detail={"queues": queues}))
            tx.execute(replays.insert().values(id=replay_id, to_queue=to_queue, rate=rate,
                                               owner=owner,
                                               lease_until=now() + timedelta(seconds=lease)))
            return replay_id, count

    def start_edit(self, row_id: int, actor: str, owner: str, *, body: bytes,
                   headers: bytes, detail: dict[str, Any], to_queue: str | None,
                   reason: str | None, lease: float) -> str:
        """An edit and replay of one parked row: the row is kept as it was and replayed with
        ``body`` and ``headers`` (an AMQP field table) instead of its own; the audit entry
        keeps the change (``detail``). Returns the replay id."""
        replay_id = uuid.uuid4().hex
        selection = Selection(ids=(row_id,))
        queue = self.store.message(row_id)
        detail = {**detail, "queues": [queue["queue"]] if queue else []}
        with self.store.tx() as tx:
            self._audit(tx, "edit", actor, selection, replay_id=replay_id, to_queue=to_queue,
                        state="running", count=1, done_count=0, refused=0, detail=detail,
                        reason=reason)
            taken = sa.select(messages.c.id, sa.literal(replay_id, sa.String(32))).where(
                selection.takeable())
            tx.execute(self.store.insert_ignore(replay_items, ["message_id"])
                       .from_select(["message_id", "replay_id"], taken))
            if not tx.execute(sa.select(replay_items.c.message_id)
                              .where(replay_items.c.replay_id == replay_id)).first():
                raise self._nothing(tx, selection, "parked", "edit")
            tx.execute(replays.insert().values(
                id=replay_id, to_queue=to_queue, rate=None, owner=owner,
                lease_until=now() + timedelta(seconds=lease), edit_body=body,
                edit_headers=headers))
        return replay_id

    def claim(self, replay_id: str, after: int, limit: int) -> Claim:
        """Claim the replay's next rows (see ``step``)."""
        return self.step(replay_id, (), (), after, limit)

    def settle(self, replay_id: str, ids: Sequence[int]) -> int:
        """Rows whose copies the broker confirmed: the replay lets go of them (see ``step``)."""
        with self.store.tx() as tx:
            return self._settle(tx, replay_id, ids)

    def unclaim(self, replay_id: str, ids: Sequence[int]) -> int:
        """Rows whose copies the broker refused: parked again, untouched (see ``step``)."""
        with self.store.tx() as tx:
            return self._unclaim(tx, replay_id, ids)

    def step(self, replay_id: str, confirmed: Sequence[int], refused: Sequence[int],
             after: int, limit: int) -> Claim:
        """One step of a replay, in one transaction: let go of the rows whose copies the broker
        ``confirmed`` (the audit entry counts them: the progress the page shows), park again
        the rows whose copies it ``refused``, and claim the next rows to publish (up to
        ``limit`` of the replay's rows, by id after ``after``; none when ``limit`` is 0).

        Claimed parked rows are written ``replayed`` now (their one write; they count as
        ``replaying`` until settled); rows it claimed before (a replay taken over from a desk
        that died) come back as they are. Once an operator asked the replay to stop
        (``cancel_by``) only those come back, to be sent again and settled (their copies may be
        out): nothing more is claimed. No rows: none is left, or the replay stops."""
        m, item = messages.c, replay_items.c
        first = True
        while True:
            with self.store.tx() as tx:
                if first:
                    self._settle(tx, replay_id, confirmed)
                    self._unclaim(tx, replay_id, refused)
                    first = False
                if limit <= 0:
                    return Claim([])
                replay = tx.execute(sa.select(replays.c.to_queue, replays.c.cancel_by)
                                    .where(replays.c.id == replay_id)).first()
                if replay is None:
                    return Claim([])
                cancelled = replay.cancel_by is not None
                ids = list(tx.execute(
                    sa.select(item.message_id)
                    .where(item.replay_id == replay_id, item.message_id > after,
                           *([] if not cancelled else [
                               item.message_id == m.id, m.status == "replayed"]))
                    .order_by(item.message_id).limit(limit)
                ).scalars())
                if cancelled and not ids:
                    return Claim([], replay.cancel_by)
                if not ids:
                    return Claim([])
                # Rows an earlier run claimed and did not settle: their copies may be out; the
                # audit counts each one re-sent (when it is claimed again, just before it is).
                again = int(tx.execute(
                    sa.select(sa.func.count()).select_from(messages)
                    .where(m.id.in_(ids), m.replay_id == replay_id,
                           no_index(m.status) == "replayed")).scalar_one())
                if again:
                    tx.execute(audit.update().where(audit.c.replay_id == replay_id)
                               .values(resent=sa.func.coalesce(audit.c.resent, 0) + again))
                # By the list of ids, never a join: with a new table's missing statistics a
                # planner may join the two tables row by row over again. ``no_index`` keeps
                # it from reading every row in a status through a status index instead.
                tx.execute(messages.update()
                           .where(m.id.in_(ids), no_index(m.status) == "parked")
                           .values(status="replayed", replay_id=replay_id,
                                   replayed_to=replay.to_queue, changed_at=now()))
                query = (
                    sa.select(m.id, m.queue, m.message_id, m.digest, m.headers_raw,
                              m.properties, m.body_text, m.body)
                    .where(m.id.in_(ids), m.replay_id == replay_id,
                           no_index(m.status) == "replayed")
                    .order_by(m.id)
                )
                rows = [dict(row._mapping) for row in tx.execute(query)]
            after = ids[-1]
            if rows:
                return Claim(rows, replay.cancel_by)
            # (a page of rows another desk discarded first: go on)

    def _settle(self, tx: Connection, replay_id: str, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        settled = _let_go(tx, replay_id, ids)
        if settled:
            per_queue = Counter({str(q): int(n) for q, n in tx.execute(
                sa.select(messages.c.queue, sa.func.count())
                .where(messages.c.id.in_(settled)).group_by(messages.c.queue))})
            self.store.add_totals(tx, "replayed", per_queue)
            tx.execute(audit.update().where(audit.c.replay_id == replay_id)
                       .values(done_count=sa.func.coalesce(audit.c.done_count, 0)
                               + len(settled)))
        return len(settled)

    def _unclaim(self, tx: Connection, replay_id: str, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        refused = _let_go(tx, replay_id, ids)
        if refused:
            tx.execute(messages.update()
                       .where(messages.c.id.in_(refused), messages.c.replay_id == replay_id)
                       .values(status="parked", replay_id=None, replayed_to=None,
                               changed_at=None))
            tx.execute(audit.update().where(audit.c.replay_id == replay_id)
                       .values(refused=sa.func.coalesce(audit.c.refused, 0) + len(refused)))
        return len(refused)

    def pending_releases(self, limit: int = 100) -> list[dict[str, Any]]:
        """Discarded holders of ordered keys whose release is not sent yet."""
        m = messages.c
        with self.store.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(
                sa.select(m.id, m.queue, m.headers_raw).where(m.release_pending.is_(True))
                .order_by(m.id).limit(limit))]

    def released(self, ids: Sequence[int]) -> None:
        if ids:
            with self.store.tx() as tx:
                tx.execute(messages.update().where(messages.c.id.in_(ids))
                           .values(release_pending=False))

    def release(self, replay_id: str) -> int:
        """A cancelled replay lets go of the rows it took and never claimed: parked, free."""
        m = messages.c
        with self.store.tx() as tx:
            unclaimed = sa.select(m.id).where(m.id == replay_items.c.message_id,
                                              m.status == "parked").exists()
            return int(tx.execute(replay_items.delete().where(
                replay_items.c.replay_id == replay_id, unclaimed)).rowcount)

    def finish(self, replay_id: str, state: str, outcome: str | None) -> int:
        """Close a replay: its audit entry says how it ended and how many were replayed; the
        lease goes. Returns how many were replayed."""
        m = messages.c
        with self.store.tx() as tx:
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
            cancel_by = tx.execute(sa.select(replays.c.cancel_by)
                                   .where(replays.c.id == replay_id)).scalar_one_or_none()
            tx.execute(audit.update().where(audit.c.replay_id == replay_id).values(
                state=state, done_count=done, done_at=now(), outcome=outcome,
                cancelled_by=cancel_by if state == "cancelled" else None))
            tx.execute(replays.delete().where(replays.c.id == replay_id))
            tx.execute(replay_items.delete().where(replay_items.c.replay_id == replay_id))
            return done

    def cancel(self, replay_id: str, actor: str) -> None:
        """Ask a running replay to stop (whichever desk runs it stops within a few rows)."""
        with self.store.tx() as tx:
            asked = tx.execute(replays.update()
                               .where(replays.c.id == replay_id, replays.c.cancel_by.is_(None))
                               .values(cancel_by=actor)).rowcount
            if asked:
                return
            if tx.execute(sa.select(replays.c.id).where(replays.c.id == replay_id)).first():
                return  # asked already
            entry = tx.execute(sa.select(audit.c.state)
                               .where(audit.c.replay_id == replay_id)).scalar_one_or_none()
        if entry is None:
            raise NotFound(f"no replay {replay_id}")
        raise Nothing(f"replay {replay_id} is not running (it is {entry})")

    def renew(self, replay_id: str, owner: str, lease: float) -> bool:
        """Extend this desk's lease of a replay; False when it lost it (another desk took it)."""
        with self.store.tx() as tx:
            return bool(tx.execute(
                replays.update().where(replays.c.id == replay_id, replays.c.owner == owner)
                .values(lease_until=now() + timedelta(seconds=lease))
            ).rowcount)

    def take_abandoned(self, owner: str, lease: float) -> Claimed | None:
        """A replay whose desk stopped renewing its lease (died), now this desk's to finish,
        with how many of its rows were claimed and not settled (their copies may be out: they
        are sent again)."""
        m = messages.c
        with self.store.tx() as tx:
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
            if not taken:
                return None
            # (The audit counts them as they are claimed again: ``step``.)
            resent = int(tx.execute(
                sa.select(sa.func.count()).select_from(replay_items)
                .join(messages, m.id == replay_items.c.message_id)
                .where(replay_items.c.replay_id == row.id, m.status == "replayed")
            ).scalar_one())
            return Claimed(row.id, row.to_queue, row.rate, row.edit_body, row.edit_headers,
                           resent)


def _let_go(tx: Connection, replay_id: str, ids: Sequence[int]) -> list[int]:
    """The replay's rows among ``ids`` that it held, no longer held (ids it did not hold stay
    out: another desk that took the replay over let go of them first)."""
    return list(tx.execute(
        replay_items.delete()
        .where(replay_items.c.replay_id == replay_id, replay_items.c.message_id.in_(ids))
        .returning(replay_items.c.message_id)
    ).scalars())


def _hold_again_or_let_go(tx: Connection, ids: Sequence[int]) -> None:
    """Restored holders of ordered keys: one whose release has not gone out holds its key again
    (the release is not sent); one whose release went out let its key go on, so its copy no
    longer names the hold (replayed with it, the worker would take it for a stale copy of a
    hold that ended and drop it): replayed, it runs as the key's newest message."""
    m = messages.c
    holds = m.headers[contract.ORDERED_HOLD].as_string()
    let_go = tx.execute(sa.select(m.id, m.headers_raw).where(
        m.id.in_(ids), holds.is_not(None), m.release_pending.is_(False))).all()
    tx.execute(messages.update().where(m.id.in_(ids), m.release_pending.is_(True))
               .values(release_pending=False))
    for row in let_go:
        headers = stored_headers(dict(row._mapping))
        headers.pop(contract.ORDERED_HOLD, None)
        headers.pop(contract.ORDERED_LANE, None)
        tx.execute(messages.update().where(m.id == row.id).values(
            headers=jsonable(headers), headers_raw=wire.encode_table(headers)))
