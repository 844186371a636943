"""Reading: the overview, queues, groups (paged, filtered) and their notes, messages (searched,
paged) and each one's history, the audit with each replay's progress and outcome, grouping
rules, ``/metrics``. A viewer may read all of it; the metrics credential only ``/metrics``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from rabbit_retry.desk.api.guard import Reader, Scraper, desk_of
from rabbit_retry.desk.api.models import (
    GROUP_ID,
    REPLAY_ID,
    ROW_ID,
    TEXT_MAX,
    jsonable_times,
    message_json,
    time_json,
)
from rabbit_retry.desk.edits import editable_headers
from rabbit_retry.desk.errors import NotFound
from rabbit_retry.desk.outbox import DEFAULT_SHOWN, DeskOutbox
from rabbit_retry.desk.outcomes import outcome
from rabbit_retry.desk.schema import SOURCES, STATUSES
from rabbit_retry.desk.store import Query as Search
from rabbit_retry.topology import naming

router = APIRouter()

PAGE_MAX = 500
OFFSET_MAX = 10**9
Status = Literal["parked", "replaying", "replayed", "discarded"]
Limit = Annotated[int, Query(ge=1, le=PAGE_MAX)]
Offset = Annotated[int, Query(ge=0, le=OFFSET_MAX)]
Text = Annotated[str | None, Query(max_length=TEXT_MAX)]
QueueName = Annotated[str | None, Query(max_length=255)]
RowIdPath = Annotated[str, Path(pattern=ROW_ID)]
GroupPath = Annotated[str, Path(pattern=GROUP_ID)]
ReplayPath = Annotated[str, Path(pattern=REPLAY_ID)]
REPLAYS = ("replay", "edit")
# The management API's queue figures lag by its statistics interval (5 s by default): until a
# replay has been done this long, every copy not parked again counts as pending.
STATS_LAG_S = 10.0
DONE_TO_ROW = {"discard": "discarded", "restore": "restored"}

assert set(STATUSES) == set(Status.__args__)  # type: ignore[attr-defined]


def _utc(moment: datetime | None) -> datetime | None:
    if moment is None:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@router.get("/api/overview")
def overview(request: Request, _who: Reader) -> dict[str, Any]:
    desk = desk_of(request)
    queues: dict[str, dict[str, Any]] = {}
    oldest: datetime | None = None
    for queue, reason, count, first in desk.store.parked_by():
        entry = queues.setdefault(queue, {"queue": queue, "parked": 0, "by_reason": {}})
        entry["parked"] += count
        entry["by_reason"][reason or "unknown"] = count
        if first is not None and (oldest is None or first < oldest):
            oldest = first
    counts = desk.store.status_counts()
    return {
        "parked": counts.get("parked", 0), "replaying": counts.get("replaying", 0),
        "replayed": counts.get("replayed", 0), "discarded": counts.get("discarded", 0),
        "oldest_parked_at": time_json(oldest),
        "queues": sorted(queues.values(), key=lambda q: q["queue"]),
        "auth": desk.access.mode,
        "consuming": bool(desk.ingest_stats is not None
                          and not getattr(desk.ingest_stats, "missing", None)),
        # With --outbox: its events dead and failed now; else null.
        "outbox": desk.outbox.counts() if desk.outbox is not None else None,
    }


@router.get("/api/queues")
def queues(request: Request, _who: Reader) -> list[dict[str, Any]]:
    desk = desk_of(request)
    parked: dict[str, int] = {}
    for queue, _reason, count, _first in desk.store.parked_by():
        parked[queue] = parked.get(queue, 0) + count
    return [{"queue": q, "parking_queue": naming.parking_queue(q), "parked": parked.get(q, 0)}
            for q in desk.queues]


@router.get("/api/groups")
def groups(request: Request, _who: Reader, queue: QueueName = None, status: Status = "parked",
           q: Text = None, limit: Limit = 100, offset: Offset = 0) -> Response:
    """One page of groups, largest first; the total is in ``X-Total-Count``."""
    total, rows = desk_of(request).store.groups(queue or None, status, text=q or None,
                                                limit=limit, offset=offset)
    return JSONResponse([jsonable_times(r) for r in rows],
                        headers={"X-Total-Count": str(total)})


@router.get("/api/groups/{group_id}")
def group(request: Request, group_id: GroupPath, _who: Reader) -> dict[str, Any]:
    desk = desk_of(request)
    found = desk.store.group(group_id)
    if found is None:
        raise NotFound(f"no group {group_id}")
    found["notes"] = [jsonable_times(n) for n in desk.store.notes(group_id)]
    return found


@router.get("/api/groups/{group_id}/notes")
def notes(request: Request, group_id: GroupPath, _who: Reader) -> list[dict[str, Any]]:
    return [jsonable_times(n) for n in desk_of(request).store.notes(group_id)]


@router.get("/api/messages")
def messages(request: Request, _who: Reader, queue: QueueName = None,
             group: Annotated[str | None, Query(max_length=16)] = None,
             status: Status | None = None, q: Text = None,
             since: datetime | None = None, until: datetime | None = None,
             replay: Annotated[str | None, Query(max_length=32)] = None,
             source: Literal[SOURCES] | None = None,  # type: ignore[valid-type]
             limit: Limit = 50, offset: Offset = 0) -> dict[str, Any]:
    search = Search(queue=queue or None, group=group or None, status=status, text=q or None,
                    since=_utc(since), until=_utc(until), replay=replay or None, source=source,
                    limit=limit, offset=offset)
    total, rows = desk_of(request).store.messages(search)
    return {"total": total, "items": [message_json(r) for r in rows]}


@router.get("/api/messages/{row_id}")
def message(request: Request, row_id: RowIdPath, _who: Reader) -> dict[str, Any]:
    row = desk_of(request).store.message(int(row_id))
    if row is None:
        raise NotFound(f"no message {row_id}")
    # What an edit may change: the headers a replay keeps, as JSON.
    return {**message_json(row), "editable_headers": editable_headers(row)}


@router.get("/api/messages/{row_id}/history")
async def history(request: Request, row_id: RowIdPath, _who: Reader) -> dict[str, Any]:
    """Every parked copy of the message (linked by message id, and by the replay a copy came
    back from), and what was done to each: parked, discarded, restored, replayed or edited
    (by whom, to where), then parked again, or not (yet)."""
    desk = desk_of(request)
    found = await asyncio.to_thread(desk.store.history, int(row_id))
    if found is None:
        raise NotFound(f"no message {row_id}")
    rows, entries, events = found
    by_id = {e["id"]: e for e in entries}
    by_replay = {e["replay_id"]: e for e in entries if e["replay_id"]}
    again = {r["replay_of"]: r["id"] for r in rows if r.get("replay_of")}
    results = await _results(desk, [e for e in entries if e["replay_id"]])
    timeline: list[dict[str, Any]] = []
    for row in rows:
        timeline.append({"at": time_json(row["parked_at"]), "event": "parked", "row": row["id"],
                         "queue": row["queue"], "reason": row["reason"],
                         "exception_type": row["exception_type"],
                         "exception_message": row["exception_message"],
                         "replay_of": row.get("replay_of"),
                         "edited": message_json(row)["edited"]})
        for message_row, audit_id in events:
            if message_row == row["id"] and audit_id in by_id:
                done = by_id[audit_id]
                timeline.append({"at": time_json(done["at"]),
                                 "event": DONE_TO_ROW.get(done["action"], done["action"]),
                                 "row": row["id"], "actor": done["actor"],
                                 "reason": done["reason"], "audit": done["id"]})
        entry = by_replay.get(row["replay_id"])
        if entry is not None:
            timeline.append(_replayed(row, entry, results.get(entry["replay_id"]), again))
    timeline.sort(key=lambda e: (e["at"] or "", e["row"]))
    return {"message_id": rows[-1]["message_id"], "rows": [message_json(r) for r in rows],
            "events": timeline}


def _replayed(row: dict[str, Any], entry: dict[str, Any], result: dict[str, Any] | None,
              again: dict[Any, Any]) -> dict[str, Any]:
    """The replay of ``row`` (its audit ``entry``) on the timeline, and what became of it."""
    if row["replay_id"] in again:
        became = "parked again"
    elif row["status"] == "replaying":
        became = "on its way"
    elif result is not None and result["pending"] == 0:
        became = "succeeded"
    else:
        became = "not parked since"
    return {
        "at": time_json(entry["at"]),
        "event": "edited and replayed" if entry["action"] == "edit" else "replayed",
        "row": row["id"], "actor": entry["actor"], "replay_id": entry["replay_id"],
        "to": row["replayed_to"] or row["queue"], "state": entry["state"],
        "then": became, "next_row": again.get(row["replay_id"]),
        "detail": entry["detail"], "audit": entry["id"]}


async def _results(desk: Any, entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each replay's outcome (``outcomes.outcome``): parked again, pending, succeeded."""
    if not entries:
        return {}
    again = await asyncio.to_thread(desk.store.parked_again,
                                    [e["replay_id"] for e in entries])
    results = {}
    moment = datetime.now(UTC)
    for entry in entries:
        sent = int(entry["done_count"] or 0)
        depth: int | None = None
        if entry["state"] == "running" or (
                entry["done_at"] is not None and (moment - entry["done_at"]).total_seconds()
                < STATS_LAG_S):
            depth = sent  # just sent: the broker's figures may not show its copies yet
        elif desk.depths is not None:
            depth = await asyncio.to_thread(_depth, desk.depths, _targets(entry))
        results[entry["replay_id"]] = outcome(sent, again.get(entry["replay_id"], 0),
                                              depth).to_json()
    return results


def _targets(entry: dict[str, Any]) -> list[str]:
    """The queues a replay published to: its ``to``, else the queues of the rows it took."""
    if entry["to_queue"]:
        return [entry["to_queue"]]
    queues = (entry.get("detail") or {}).get("queues")
    return [str(q) for q in queues] if isinstance(queues, list) else []


def _depth(depths: Any, queues: list[str]) -> int | None:
    total = 0
    for queue in queues:
        depth = depths.depth(queue)
        if depth is None:
            return None
        total += depth
    return total if queues else None


def replay_json(entry: dict[str, Any], result: dict[str, Any] | None) -> dict[str, Any]:
    """A replay's audit entry with its progress (done of total, rate, estimate) and outcome."""
    out = jsonable_times(entry)
    if entry["action"] not in REPLAYS:
        return out
    total = int(entry["count"] or 0)
    done = int(entry["done_count"] or 0)
    refused = int(entry["refused"] or 0)
    end = entry["done_at"] or datetime.now(UTC)
    seconds = max((end - entry["at"]).total_seconds(), 0.001)
    rate = done / seconds
    left = max(total - done - refused, 0)
    out["progress"] = {
        "total": total, "done": done, "refused": refused, "left": left,
        "rate": round(rate, 1),
        "eta_s": (round(left / rate, 1) if rate > 0 else None)
        if entry["state"] == "running" else 0,
    }
    out["results"] = result
    return out


@router.get("/api/audit")
async def audit_log(request: Request, _who: Reader, limit: Limit = 100,
                    offset: Offset = 0) -> list[dict[str, Any]]:
    desk = desk_of(request)
    entries = await asyncio.to_thread(desk.store.audit, limit, offset)
    results = await _results(desk, [e for e in entries if e["action"] in REPLAYS])
    return [replay_json(e, results.get(e["replay_id"] or "")) for e in entries]


@router.get("/api/replays/{replay_id}")
async def replay(request: Request, replay_id: ReplayPath, _who: Reader) -> dict[str, Any]:
    """One replay's audit entry, progress and outcome (the page polls it while it runs)."""
    desk = desk_of(request)
    entry = await asyncio.to_thread(desk.store.audit_entry, replay_id)
    if entry is None:
        raise NotFound(f"no replay {replay_id}")
    results = await _results(desk, [entry])
    return replay_json(entry, results.get(replay_id))


@router.get("/api/held")
def held(request: Request, _who: Reader, queue: QueueName = None, limit: Limit = 100,
         offset: Offset = 0) -> dict[str, Any]:
    """Ordered keys a parked message holds (``on_park: hold``): per queue how many, and one page
    of them (by queue, oldest first), each with the stored message holding it and since when
    (its parked time). Replaying or discarding the message releases its key."""
    by_queue, rows = desk_of(request).store.held(queue or None, limit, offset)
    total = by_queue.get(queue, 0) if queue else sum(by_queue.values())
    return {"total": total,
            "queues": [{"queue": q, "held_keys": n} for q, n in sorted(by_queue.items())],
            "items": [{"queue": r["queue"], "key": r["key"], "hold": r["hold"],
                       "message": r["id"], "message_id": r["message_id"],
                       "since": time_json(r["parked_at"]), "reason": r["reason"],
                       "exception_type": r["exception_type"],
                       "exception_message": r["exception_message"]} for r in rows]}


def outbox_of(request: Request) -> DeskOutbox:
    outbox = desk_of(request).outbox
    if outbox is None:
        raise NotFound("this desk reads no outbox (rabbit-retry desk FILE --outbox URL)")
    return outbox


OutboxStatus = Literal["dead", "failed", "discarded"]


@router.get("/api/outbox")
def outbox_events(request: Request, _who: Reader, status: OutboxStatus | None = None,
                  destination: QueueName = None, q: Text = None, limit: Limit = 50,
                  offset: Offset = 0) -> dict[str, Any]:
    """The outbox's events an operator may act on: dead and failed (or one of them, or the
    discarded), newest change first, a page at a time; ``q`` is a message id or order key."""
    outbox = outbox_of(request)
    total, items = outbox.events((status,) if status else DEFAULT_SHOWN, destination or None,
                                 (q or "").strip() or None, limit, offset)
    return {"total": total, "outbox": outbox.name, "items": items}


@router.get("/api/outbox/{event_id}")
def outbox_event(request: Request, event_id: RowIdPath, _who: Reader) -> dict[str, Any]:
    """One outbox event, with its history: added, each failure with the broker's reason, dead,
    operators' retries and discards (who, why), published."""
    return outbox_of(request).event(int(event_id))


@router.get("/api/rules")
def rules(request: Request, _who: Reader) -> list[dict[str, Any]]:
    return [jsonable_times(r) for r in desk_of(request).store.rules()]


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, _who: Scraper) -> Response:
    return PlainTextResponse(generate_latest(desk_of(request).registry),
                             media_type=CONTENT_TYPE_LATEST)
