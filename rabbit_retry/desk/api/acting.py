"""Acting (the operator role): replay, discard, restore, edit and replay, cancel a replay, notes
on a group, grouping rules, an outbox's retry and discard. Each is recorded under the
authenticated name; one that selects nothing it may act on answers 404 or 409 and records
nothing."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from rabbit_retry.desk.api.guard import Actor, desk_of
from rabbit_retry.desk.api.models import (
    GROUP_ID,
    REPLAY_ID,
    ROW_ID,
    CancelBody,
    DiscardBody,
    EditBody,
    NoteBody,
    OutboxDiscardBody,
    OutboxRetryBody,
    ReplayBody,
    RestoreBody,
    RuleBody,
    jsonable_times,
)
from rabbit_retry.desk.api.reading import outbox_of, replay_json
from rabbit_retry.desk.groups import Rule
from rabbit_retry.desk.replay import Replay, ReplayResult

log = logging.getLogger("rabbit_retry.desk")
router = APIRouter()


async def _answer(request: Request, replay: Replay, task: asyncio.Task[ReplayResult],
                  wait: float, extra: dict[str, Any]) -> Response:
    """The replay's end when it comes within ``wait`` seconds; else 202 and its progress."""
    done, _ = await asyncio.wait({task}, timeout=wait)
    replay_id = replay.claimed.id
    if done and not task.cancelled() and task.exception() is None:
        result = task.result()
        body: dict[str, Any] = {"replayed": result.replayed, "replay_id": replay_id,
                                "state": result.state.value, **extra}
        if result.outcome:
            body["refused"] = result.refused
            body["error"] = result.outcome
        return JSONResponse(body)
    entry = await asyncio.to_thread(desk_of(request).store.audit_entry, replay_id)
    progress = replay_json(entry, None)["progress"] if entry else None
    return JSONResponse({"replayed": 0, "replay_id": replay_id, "pending": True,
                         "state": "running", "progress": progress, **extra}, status_code=202)


@router.post("/api/replay")
async def replay(request: Request, body: ReplayBody, who: Actor) -> Response:
    desk = desk_of(request)
    selection = body.selection()
    replay, task = await desk.actions.replay(selection, who.name, to=body.to,
                                             rate=float(body.rate) if body.rate else None)
    extra = {"skipped": len(selection.ids) - replay.result.claimed} if selection.ids else {}
    return await _answer(request, replay, task, float(body.wait), extra)


@router.post("/api/discard")
async def discard(request: Request, body: DiscardBody, who: Actor) -> dict[str, Any]:
    count = await desk_of(request).actions.discard(body.selection(), who.name, body.reason)
    return {"discarded": count}


@router.post("/api/restore")
async def restore(request: Request, body: RestoreBody, who: Actor) -> dict[str, Any]:
    """Discarded messages parked again (until ``--keep`` ends, a discard can be undone)."""
    count = await desk_of(request).actions.restore(body.selection(), who.name, body.reason)
    return {"restored": count}


@router.post("/api/outbox/retry")
async def outbox_retry(request: Request, body: OutboxRetryBody, who: Actor) -> dict[str, Any]:
    """Dead or failed outbox events back to pending: the relay publishes them (the desk never
    does). ``skipped``: listed ids that were neither."""
    outbox, ledger = outbox_of(request), desk_of(request).actions.ledger
    ids = body.unique()
    reason = body.reason.strip() if body.reason and body.reason.strip() else None
    count = await asyncio.to_thread(outbox.retry, ledger, ids, who.name, reason)
    return {"retried": count, "skipped": len(ids) - count}


@router.post("/api/outbox/discard")
async def outbox_discard(request: Request, body: OutboxDiscardBody,
                         who: Actor) -> dict[str, Any]:
    """Dead or failed outbox events never to be published, with the reason."""
    outbox, ledger = outbox_of(request), desk_of(request).actions.ledger
    ids = body.unique()
    count = await asyncio.to_thread(outbox.discard, ledger, ids, who.name, body.reason.strip())
    return {"discarded": count, "skipped": len(ids) - count}


@router.post("/api/messages/{row_id}/edit")
async def edit(request: Request, row_id: Annotated[str, Path(pattern=ROW_ID)], body: EditBody,
               who: Actor) -> Response:
    """Replay one parked message with a changed body or headers: the stored message stays as
    it was; the copy is marked ``replay-edited``; the audit keeps the change as a diff."""
    desk = desk_of(request)
    replay, task = await desk.actions.edit(int(row_id), who.name, body=body.new_body(),
                                           headers=body.headers, to=body.to,
                                           reason=body.reason)
    return await _answer(request, replay, task, float(body.wait), {})


@router.post("/api/replays/{replay_id}/cancel")
async def cancel(request: Request, replay_id: Annotated[str, Path(pattern=REPLAY_ID)],
                 who: Actor, _body: CancelBody | None = None) -> dict[str, Any]:
    await desk_of(request).actions.cancel(replay_id, who.name)
    return {"cancelling": replay_id}


@router.post("/api/groups/{group_id}/notes")
async def add_note(request: Request, group_id: Annotated[str, Path(pattern=GROUP_ID)],
                   body: NoteBody, who: Actor) -> dict[str, Any]:
    note = await asyncio.to_thread(desk_of(request).store.add_note, group_id, who.name,
                                   body.text.strip())
    return jsonable_times(note)


@router.post("/api/rules")
async def add_rule(request: Request, body: RuleBody, who: Actor) -> dict[str, Any]:
    """A grouping rule of the operator's: what ``pattern`` matches in an exception message
    becomes ``<name>``. Stored messages are regrouped in the background."""
    desk = desk_of(request)
    if body.queue is not None:
        desk.actions.check_queue(body.queue)
    rule = await asyncio.to_thread(desk.store.add_rule, Rule(body.pattern, body.name,
                                                             body.queue), who.name)
    desk.regroup_soon()
    return jsonable_times(rule)


@router.delete("/api/rules/{rule_id}")
async def remove_rule(request: Request, rule_id: Annotated[str, Path(pattern=ROW_ID)],
                      who: Actor) -> dict[str, Any]:
    desk = desk_of(request)
    await asyncio.to_thread(desk.store.remove_rule, int(rule_id), who.name)
    desk.regroup_soon()
    return {"removed": int(rule_id)}
