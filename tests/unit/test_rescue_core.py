"""The pure parts of ``rabbit-retry rescue`` (rabbit_retry/rescue.py): which messages the
broker's cycle check holds, what a run would do, what a parked copy says."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rabbit_retry.broker.replicas import Replication
from rabbit_retry.cli import main
from rabbit_retry.rescue import (
    cannot_line,
    done_waiting_for_copies,
    first_tier,
    is_dead_letter_cycle,
    let_go,
    parked_copy_headers,
    survey,
)
from rabbit_retry.status import QueueStatus, Status
from rabbit_retry.topology import compile_topology, parse_topology

FILE = """
version: 1
queues:
  stuck:
    retry: {delays: [200ms, 5s], max_attempts: 3}
  parked:
    retry: {delays: [1s], max_attempts: 3}
    on_expire: park
    policy: {message_ttl: 1m}
"""
PLAN = compile_topology(parse_topology(FILE))
TIER = "stuck.retry.200ms"


def death(queue: str, reason: str, count: int = 1) -> dict[str, Any]:
    return {"queue": queue, "reason": reason, "count": count, "exchange": "",
            "routing-keys": ["stuck"]}


# x-death is newest first, as the broker writes it on every version.
STRANDED_IN_Q = [death("stuck", "delivery_limit"), death(TIER, "expired"),
                 death("stuck", "rejected")]
NACKED = [death("stuck", "rejected", 2), death(TIER, "expired")]
FIRST_LIMIT = [death("stuck", "delivery_limit")]


@pytest.mark.parametrize(("target", "deaths", "cycle"), [
    (TIER, STRANDED_IN_Q, True),  # the tier, and no rejection since: the broker refuses it
    (TIER, NACKED, False),  # a client rejected it since it left the tier
    (TIER, FIRST_LIMIT, False),  # never in the tier: it goes there
    ("stuck", [death(TIER, "expired"), death("stuck", "delivery_limit")], True),
    ("stuck", [death(TIER, "expired"), death("stuck", "rejected")], False),
    (TIER, None, False),
    (TIER, "garbled", False),
    (TIER, ["garbled", death(TIER, "expired")], True),
])
def test_a_cycle_is_what_the_broker_calls_one(target: str, deaths: object, cycle: bool) -> None:
    assert is_dead_letter_cycle(target, deaths) is cycle


def test_the_first_tier_is_the_one_bound_with_the_queues_name() -> None:
    binding = first_tier(PLAN, "stuck")
    assert binding is not None
    assert (binding.source, binding.destination, binding.routing_key) == \
        ("stuck.retry", TIER, "stuck")
    assert first_tier(PLAN, "parked") is None  # its dead letters go to parking


def row(queue: str, held: dict[str, int], stranded: tuple[str, ...] | None = None
        ) -> QueueStatus:
    return QueueStatus(queue, 0, 0, 0, 0, 0, (), held=tuple(held.items()),
                       stranded=tuple(held) if stranded is None else stranded)


def status(*rows: QueueStatus) -> Status:
    return Status("v", "f.yml", rows, ())


def test_survey_moves_what_is_held_in_the_queue_and_names_each_tier_it_cannot() -> None:
    found = survey(status(row("stuck", {"stuck": 2, TIER: 1}), row("parked", {})), PLAN, [])
    assert [(w.queue, w.stranded, w.leftover) for w in found.work] == [("stuck", 2, False)]
    assert found.cannot == (cannot_line(TIER, 1, "stuck"),)
    assert found.cannot[0].startswith(f"{TIER}: 1 message stranded by RabbitMQ's dead-letter "
                                      "cycle check cannot be moved")


def test_survey_finds_nothing_in_a_queue_held_for_a_missing_queue_or_not_selected() -> None:
    missing = row("stuck", {"stuck": 2}, stranded=())  # its next queue is missing: apply
    assert survey(status(missing), PLAN, []).work == ()
    assert survey(status(row("stuck", {"stuck": 2})), PLAN, [], ["parked"]).work == ()


def test_survey_picks_up_what_an_earlier_run_left_in_q_rescue() -> None:
    found = survey(status(row("stuck", {})), PLAN, ["stuck"])
    assert [(w.queue, w.stranded, w.leftover) for w in found.work] == [("stuck", 0, True)]
    assert "and what stuck.rescue holds from an earlier run" in found.work[0].line


def test_a_queue_whose_dead_letters_go_to_parking_is_not_a_cycle_to_break() -> None:
    found = survey(status(row("parked", {"parked": 1})), PLAN, [])
    assert found.work == ()
    assert found.cannot[0].startswith("parked: 1 message held for dead-lettering")


@pytest.mark.parametrize(("held", "in_queue", "done"), [
    (0, 1, False), (1, 1, True), (2, 1, True), (0, 0, True), (1, 2, False),
])
def test_step_one_ends_once_every_held_message_came(held: int, in_queue: int,
                                                      done: bool) -> None:
    assert done_waiting_for_copies(held, in_queue) is done


@pytest.mark.parametrize(("in_queue", "highest", "held", "done"), [
    (1, 1, 1, False), (0, 1, 1, True), (1, 2, 1, True), (2, 3, 1, True), (3, 3, 1, False),
    (1, 1, 3, False), (0, 1, 3, True),
])
def test_step_two_ends_once_the_queue_let_go(in_queue: int, highest: int, held: int,
                                             done: bool) -> None:
    assert let_go(in_queue, highest, held) is done


def test_a_parked_copy_says_why_and_keeps_the_history() -> None:
    headers = {"x-death": STRANDED_IN_Q, "app": "kept", "x-delivery-count": 3}
    now = datetime(2026, 11, 28, 4, 0, tzinfo=UTC)
    copied = parked_copy_headers(headers, "stuck", now=now, expiration="5000")
    assert copied["parked-reason"] == "stranded"
    assert copied["exception-type"] == "rabbit_retry.rescue.StrandedByDeadLetterCycle"
    assert "last death: delivery_limit" in copied["exception-message"]
    assert copied["retry-count"] == 2  # a rejection and a delivery limit on stuck
    assert copied["original-queue"] == "stuck"
    assert (copied["original-exchange"], copied["original-routing-key"]) == ("", "stuck")
    assert copied["original-expiration"] == "5000"
    assert copied["parked-at"] == "2026-11-28T04:00:00.000Z"
    assert copied["app"] == "kept" and copied["x-death"] == STRANDED_IN_Q


@pytest.mark.parametrize(("args", "line"), [
    (["--interval", "soon"], "error: --interval: bad duration 'soon'"),
    (["nope"], "error: QUEUE 'nope': not a queue of"),
])
def test_bad_input_is_refused_before_the_broker_is_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    path = tmp_path / "f.yml"
    path.write_text(FILE, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["--url", "amqp://u:p@127.0.0.1:1/", "rescue", str(path), *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(line)


def test_a_queue_whose_tier_has_a_replica_offline_is_not_rescued() -> None:
    down = Replication(TIER, "n1", ("n1", "n2", "n3"), ("n1", "n2"))
    elsewhere = Replication("stuck.retry.5s", "n1", ("n1", "n2"), ("n1",))
    stuck = dataclasses.replace(row("stuck", {"stuck": 1}), replicas=(down,))
    found = survey(status(stuck), PLAN, [])
    assert found.work == ()
    assert found.cannot == ("stuck: not rescued while a replica of stuck.retry.200ms is offline "
                            "(n3): the tier must confirm what stuck dead-letters meanwhile; run "
                            "rescue again once it is online",)
    fine = dataclasses.replace(stuck, replicas=(elsewhere,))  # not on the way: no matter
    assert [w.queue for w in survey(status(fine), PLAN, []).work] == ["stuck"]


class _Channel:
    """Records the bindings a channel is asked for; one whose call was cancelled refuses every
    call, as aiormq's does, though it does not say it is closed until the broker answered."""

    def __init__(self, calls: list[tuple[str, str]], *, closing: bool = False) -> None:
        self.calls, self.closing, self.is_closed = calls, closing, False

    async def queue_bind(self, queue: str, exchange: str, **_: Any) -> None:
        self._call("bind", queue)

    async def queue_unbind(self, queue: str, exchange: str, **_: Any) -> None:
        self._call("unbind", queue)

    def _call(self, what: str, queue: str) -> None:
        if self.closing:
            raise RuntimeError("Channel closed by RPC timeout")
        self.calls.append((what, queue))


class _Connection:
    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls

    async def channel(self) -> _Connection:
        return self

    async def get_underlay_channel(self) -> _Channel:
        return _Channel(self.calls)


def test_a_run_stopped_in_the_middle_of_a_call_puts_the_bindings_back_on_a_new_channel() -> None:
    """Ctrl-C cancels the call under way, and aiormq closes a channel whose call was cancelled
    (CI runs on 4.0 and 4.3 under load stopped rescue so): the bindings go back on a channel of
    their own, and the operator is told they are as the file has them."""
    import asyncio

    from rabbit_retry.rescue import Work, _Run, _stopped
    from rabbit_retry.settings import Settings
    from rabbit_retry.topology.plan import Binding

    calls: list[tuple[str, str]] = []
    work = Work("stuck", Binding("stuck.retry", TIER, "stuck"), stranded=1)
    run = _Run(_Channel(calls, closing=True), None, Settings("amqp://127.0.0.1/"),  # type: ignore[arg-type]
               work, 1.0, print)
    said = asyncio.run(_stopped(run, _Connection(calls)))  # type: ignore[arg-type]
    assert calls == [("bind", TIER), ("unbind", "stuck.rescue")]
    assert "stuck: stopped; stuck.retry's bindings are as the file has them" in said
