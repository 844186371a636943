"""What the API accepts (pydantic request models, bounded: every number has a range, every list
and text a length) and how it shows stored rows (``message_json``)."""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

from rabbit_retry import contract
from rabbit_retry.desk.errors import DeskError
from rabbit_retry.desk.records import body_text, stored_body
from rabbit_retry.desk.store import Selection

ROW_ID_MAX = 2**63 - 1
MAX_IDS = 10_000  # SQLite takes at most 32,766 parameters in one statement
TEXT_MAX = 1000  # a reason, a note, a search
ROW_ID = r"^[0-9]{1,18}$"  # ASCII digits only: int() would take "٣" for 3
GROUP_ID = r"^[0-9a-f]{16}$"
REPLAY_ID = r"^[0-9a-f]{32}$"
QUEUE_MAX = 255

RowId = Annotated[StrictInt, Field(ge=1, le=ROW_ID_MAX)]
Rate = Annotated[StrictInt | StrictFloat, Field(gt=0, le=100_000, allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Select(_Body):
    """``{"ids": [...]}`` or ``{"group": ID}``."""

    ids: Annotated[list[RowId], Field(min_length=1, max_length=MAX_IDS)] | None = None
    group: Annotated[str, Field(pattern=GROUP_ID)] | None = None

    @model_validator(mode="after")
    def _one(self) -> Select:
        if (self.ids is None) == (self.group is None):
            raise ValueError('say which messages: "ids": [...] or "group": ID (one of the two)')
        return self

    def selection(self) -> Selection:
        if self.group is not None:
            return Selection(group=self.group)
        assert self.ids is not None
        return Selection(ids=tuple(dict.fromkeys(self.ids)))


class ReplayBody(Select):
    to: Annotated[str, Field(min_length=1, max_length=QUEUE_MAX)] | None = None
    rate: Rate | None = None
    # How long to wait for the replay to end before answering 202 with its progress.
    wait: Annotated[StrictInt | StrictFloat, Field(ge=0, le=60, allow_inf_nan=False)] = 30


class DiscardBody(Select):
    reason: Annotated[str, Field(max_length=TEXT_MAX)]

    @model_validator(mode="after")
    def _reason(self) -> DiscardBody:
        if not self.reason.strip():
            raise ValueError('"reason": a discard needs a reason (text)')
        return self


class RestoreBody(Select):
    reason: Annotated[str, Field(max_length=TEXT_MAX)] | None = None


class EditBody(_Body):
    """An edit and replay: a new body (text, or base64 for bytes), the message's headers as
    they should be (all of the editable ones; omitted: unchanged), where to, why."""

    body: Annotated[str, Field(max_length=4 * 2**20)] | None = None
    body_base64: Annotated[str, Field(max_length=6 * 2**20)] | None = None
    headers: dict[Annotated[str, Field(min_length=1, max_length=255)], Any] | None = None
    to: Annotated[str, Field(min_length=1, max_length=QUEUE_MAX)] | None = None
    reason: Annotated[str, Field(max_length=TEXT_MAX)] | None = None
    wait: Annotated[StrictInt | StrictFloat, Field(ge=0, le=60, allow_inf_nan=False)] = 30

    @model_validator(mode="after")
    def _one_body(self) -> EditBody:
        if self.body is not None and self.body_base64 is not None:
            raise ValueError('"body" or "body_base64", not both')
        return self

    def new_body(self) -> bytes | None:
        if self.body is not None:
            try:
                return self.body.encode("utf-8")
            except UnicodeEncodeError:
                raise DeskError('"body": not encodable as UTF-8 (lone surrogates?)') from None
        if self.body_base64 is not None:
            try:
                return base64.b64decode(self.body_base64, validate=True)
            except (binascii.Error, ValueError):
                raise DeskError('"body_base64": not base64') from None
        return None


class NoteBody(_Body):
    text: Annotated[str, Field(min_length=1, max_length=TEXT_MAX)]

    @model_validator(mode="after")
    def _text(self) -> NoteBody:
        if not self.text.strip():
            raise ValueError('"text": an empty note')
        return self


class RuleBody(_Body):
    pattern: Annotated[str, Field(min_length=1, max_length=200)]
    name: Annotated[str, Field(min_length=1, max_length=24)]
    queue: Annotated[str, Field(min_length=1, max_length=QUEUE_MAX)] | None = None


class OutboxSelect(_Body):
    """An operator's retry or discard of outbox events: ``{"ids": [...]}`` (the events' ids in
    the outbox table)."""

    ids: Annotated[list[RowId], Field(min_length=1, max_length=MAX_IDS)]

    def unique(self) -> list[int]:
        return list(dict.fromkeys(self.ids))


class OutboxRetryBody(OutboxSelect):
    reason: Annotated[str, Field(max_length=TEXT_MAX)] | None = None


class OutboxDiscardBody(OutboxSelect):
    reason: Annotated[str, Field(max_length=TEXT_MAX)]

    @model_validator(mode="after")
    def _reason(self) -> OutboxDiscardBody:
        if not self.reason.strip():
            raise ValueError('"reason": a discard needs a reason (text)')
        return self


class CancelBody(_Body):
    pass


# --- rows as JSON --------------------------------------------------------------------------------


def time_json(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def jsonable_times(row: dict[str, Any]) -> dict[str, Any]:
    return {k: time_json(v) if isinstance(v, datetime) else v for k, v in row.items()}


def message_json(row: dict[str, Any]) -> dict[str, Any]:
    body = stored_body(row)
    headers = row["headers"] or {}
    out: dict[str, Any] = {
        "id": row["id"], "source": row.get("source", "parking"), "queue": row["queue"],
        "message_id": row["message_id"],
        # Ours, not the publisher's: rabbit-retry made it up for a message that had none.
        "message_id_generated": headers.get(contract.MESSAGE_ID_GENERATED) is True,
        "correlation_id": row["correlation_id"], "status": row["status"],
        "reason": row["reason"], "exception_type": row["exception_type"],
        "exception_message": row["exception_message"], "attempts": row["attempts"],
        "parked_at": time_json(row["parked_at"]), "group": row["group_id"],
        "headers": headers, "properties": row["properties"],
        "replay_id": row["replay_id"], "replayed_to": row["replayed_to"],
        "replay_of": row.get("replay_of"),
        "edited": headers.get(contract.REPLAY_EDITED) is True,
        "discard_reason": row["discard_reason"], "changed_at": time_json(row["changed_at"]),
        # A parked copy that holds its ordered key: the key (replaying or discarding it lets
        # the key's later messages go on).
        "holds_key": (_text(headers.get(contract.ORDERED_KEY))
                      if row["status"] == "parked" and _text(headers.get(contract.ORDERED_HOLD))
                      is not None else None),
    }
    text = body_text(body)
    if text is not None:
        out["body"] = text
    else:
        out["body_base64"] = base64.b64encode(body).decode("ascii")
    return out


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
