"""An application's outbox as the desk shows it (``rabbit-retry desk FILE --outbox URL``): its
failed and dead events beside the parked messages, and an operator's retry or discard of them,
recorded in the desk's audit.

The desk only reads the outbox table and changes an event's status (``OutboxStore.retry`` and
``discard``, each with its own history entry naming the operator, in the application's
database); it never publishes an event itself: a retried event is ``pending`` again and the
relay publishes it. It neither creates nor migrates the outbox's tables (the relay does), and
refuses to start on a database whose schema is not the one it reads.

The change to the outbox and the desk's audit entry are two databases, so two transactions: the
outbox's first (its history keeps who and why, whatever happens next), then the audit entry,
which counts the events the outbox took. An action that takes none writes neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rabbit_retry.desk.api.models import time_json
from rabbit_retry.desk.errors import NotFound, Nothing
from rabbit_retry.desk.ledger import Ledger
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import shown as shown_url

RETRY = "outbox-retry"
DISCARD = "outbox-discard"
# What ``GET /api/outbox`` lists: an operator's business, not what waits for the relay.
SHOWN = ("dead", "failed", "discarded")
DEFAULT_SHOWN = ("dead", "failed")
ACTED_ON = ("dead", "failed")


class DeskOutbox:
    def __init__(self, url: str) -> None:
        from rabbit_retry.database import engine_url
        from rabbit_retry.outbox.store import OutboxStore

        self.url = url
        self.name = shown_url(url)
        target = engine_url(url, "--outbox")
        if target.get_backend_name() == "sqlite" and not Path(target.database or "").is_file():
            # Connecting would make an empty database there: a typo's, not the application's.
            raise InputError(f"--outbox {self.name}: no such file")
        self.store = OutboxStore(url, pool_size=2)

    def close(self) -> None:
        self.store.close()

    def check(self) -> None:
        """The outbox's tables are there, at the revision this code reads (the relay makes
        them); else one line saying what to do."""
        from rabbit_retry.outbox.store import HEAD

        try:
            found = self.store.revision()
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BrokerError(f"--outbox {self.name}: cannot read it: {first}") from None
        if not self.store.up_to_date(found):
            state = "no outbox tables" if found is None else f"outbox revision {found}"
            raise BrokerError(
                f"--outbox {self.name}: has {state}; the desk reads revision {HEAD} (run "
                "`rabbit-retry relay` on it once, which migrates it, or apply "
                "rabbit_retry/outbox/sql/*.sql)")

    # --- reading --------------------------------------------------------------------------------

    def events(self, statuses: Sequence[str], destination: str | None, text: str | None,
               limit: int, offset: int) -> tuple[int, list[dict[str, Any]]]:
        from rabbit_retry.outbox.view import shown

        total, rows = self.store.events(status=statuses, destination_name=destination,
                                        text=text, limit=limit, offset=offset)
        return total, [_listed(shown(r)) for r in rows]

    def event(self, event_id: int) -> dict[str, Any]:
        from rabbit_retry.outbox.view import shown

        found = self.store.event(event_id)
        if found is None:
            raise NotFound(f"no outbox event {event_id}")
        return _listed(shown(found))

    def counts(self) -> dict[str, int]:
        """Events dead and failed now (the overview's)."""
        figures = self.store.figures()
        return {"dead": sum(figures.dead.values()), "failed": sum(figures.failed.values())}

    # --- acting ---------------------------------------------------------------------------------

    def retry(self, ledger: Ledger, ids: Sequence[int], actor: str, reason: str | None) -> int:
        """Dead or failed events back to ``pending`` (the relay publishes them, with a fresh
        count of attempts); the audit entry ``outbox-retry``. Returns how many it took."""
        taken = self.store.retry(ids, actor)
        return self._recorded(ledger, RETRY, "retry", ids, taken, actor, reason)

    def discard(self, ledger: Ledger, ids: Sequence[int], actor: str, reason: str) -> int:
        """Dead or failed events never to be published; the audit entry ``outbox-discard``."""
        taken = self.store.discard(ids, actor, reason)
        return self._recorded(ledger, DISCARD, "discard", ids, taken, actor, reason)

    def _recorded(self, ledger: Ledger, action: str, verb: str, ids: Sequence[int],
                  taken: list[int], actor: str, reason: str | None) -> int:
        if not taken:
            raise self._nothing(ids, verb)
        ledger.record(action, actor, {"outbox": self.name, "outbox_ids": sorted(taken)},
                      len(taken), reason)
        return len(taken)

    def _nothing(self, ids: Sequence[int], verb: str) -> Exception:
        if len(ids) == 1:
            found = self.store.event(ids[0])
            if found is None:
                return NotFound(f"no outbox event {ids[0]}")
            return Nothing(f"nothing to {verb}: outbox event {ids[0]} is {found['status']}, "
                           "not dead or failed")
        return Nothing(f"nothing to {verb}: none of the {len(ids)} outbox events is dead or "
                       "failed (or they do not exist)")


def _listed(view: dict[str, Any]) -> dict[str, Any]:
    """The view with times in the desk's form (UTC, ``Z``)."""
    out = dict(view)
    for name in ("created_at", "changed_at", "due_at", "published_at"):
        if out.get(name):
            out[name] = time_json(datetime.fromisoformat(out[name]))
    if "history" in out:
        out["history"] = [{**e, "at": time_json(datetime.fromisoformat(e["at"]))
                           if e.get("at") else None} for e in out["history"]]
    return out
