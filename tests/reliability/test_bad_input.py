"""Bad input through the real worker process: bodies that are empty, not UTF-8, not JSON or
as large as the broker takes (16 MiB, its limit on 4.x); headers of the wrong types, by hand
and fuzzed with hypothesis; exceptions megabytes long. Each message ends parked with the
reason and the text a user sees, or handled with the attempt number the rules give; nothing is
lost and the worker never logs an internal error.

The pure rules are fuzzed with many more examples in tests/unit/test_attempts.py and
tests/unit/test_worker_copies.py; here a few examples go through the broker.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiormq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import header as pamqp_header
from rel_support import Worker, ok_ids, records, spec_body
from support.amqp import Outgoing, Taken, drain_sync, publish_sync, total_depth
from support.broker import ctl, version
from support.poll import wait_for
from support.process import apply, cli

from rabbit_retry.broker.management import Management
from rabbit_retry.contract import copy_properties
from rabbit_retry.settings import Settings
from rabbit_retry.wire import encoded_size
from rabbit_retry.worker.history import read

MiB = 1024 * 1024
FRAME_MAX = 131072  # RabbitMQ's default, which the test broker uses

TOPOLOGY = """\
version: 1
queues:
  rel.orders:
    retry: {delays: [200ms, 400ms], max_attempts: 4}
  rel.payments:
    retry: {delays: [300ms], max_attempts: 3}
  rel.typed:
    queue_type: classic
    retry: {delays: [200ms], max_attempts: 2}
"""
QUEUES = {"rel.orders": 4, "rel.payments": 3, "rel.typed": 2}  # queue -> max_attempts
ALL = [q for name in QUEUES for q in (name, f"{name}.parking")] + [
    "rel.orders.retry.200ms", "rel.orders.retry.400ms", "rel.payments.retry.300ms",
    "rel.typed.retry.200ms"]
WORK = ["rel.orders", "rel.orders.retry.200ms", "rel.orders.retry.400ms", "rel.payments",
        "rel.payments.retry.300ms", "rel.typed", "rel.typed.retry.200ms"]


@pytest.fixture
def worker(fresh_vhost: Settings, tmp_path: Path, records: Path) -> Iterator[Worker]:
    topology = tmp_path / "rel.yml"
    topology.write_text(TOPOLOGY)
    apply(fresh_vhost, topology)
    running = Worker(fresh_vhost, topology, records, "Orders", "Payments", "Typed", prefetch=4)
    running.start()
    yield running
    try:
        log = running.log()
        assert "internal error" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        running.stop()
    finally:
        running.ensure_dead()


class Parked:
    """Every message parked so far, by id (several copies of one id would be duplicates)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.by_id: dict[str, list[Taken]] = {}

    def take(self) -> dict[str, list[Taken]]:
        for queue in QUEUES:
            for message in drain_sync(self.settings, f"{queue}.parking"):
                assert message.message_id is not None
                self.by_id.setdefault(message.message_id, []).append(message)
        return self.by_id

    def one(self, message_id: str) -> Taken:
        [message] = self.by_id[message_id]
        return message


def _resolved(settings: Settings, worker: Worker, parked: Parked, ids: set[str]) -> bool:
    done = ok_ids(worker.records) | set(parked.take())
    return ids <= done and total_depth(settings, WORK) == 0


def _settled(settings: Settings, worker: Worker, parked: Parked, ids: set[str]) -> None:
    wait_for(lambda: _resolved(settings, worker, parked, ids), f"{len(ids)} messages to settle",
             interval=0.3)


def _calls(worker: Worker) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for message_id, attempt in records(worker.records, "calls"):
        out.setdefault(message_id, []).append(attempt)
    return out


# --- bodies --------------------------------------------------------------------------------


JSON_BODIES = {
    "empty": (b"", "body is not JSON: Expecting value: line 1 column 1 (char 0)"),
    "not-utf8": (b"\x80abc", "body is not JSON: 'utf-8' codec can't decode byte 0x80 in "
                             "position 0: invalid start byte"),
    "utf8-then-junk": (b'{"id": "\xff"}', "body is not JSON: 'utf-8' codec can't decode byte "
                                          "0xff in position 8: invalid start byte"),
    "not-json": (b"not json {", "body is not JSON: Expecting value: line 1 column 1 (char 0)"),
}
MODEL_BODIES = {
    "empty": (b"", "Invalid JSON: EOF while parsing a value at line 1 column 0"),
    "not-utf8": (b"\x80abc", "Invalid JSON: expected value at line 1 column 1"),
    "not-json": (b"not json {", "Invalid JSON: expected ident at line 1 column 2"),
    "wrong-shape": (b'{"id": 1}', "2 validation errors for Order"),
}


def _json_of_size(fields: dict[str, Any], pad: str, size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes: ``fields`` and a ``pad`` string filling it."""
    empty = len(json.dumps({**fields, pad: ""}).encode())
    body = json.dumps({**fields, pad: "a" * (size - empty)}).encode()
    assert len(body) == size, f"built {len(body)} bytes of JSON for {size}"
    return body


# What each version refuses when nothing configures max_message_size (rabbit.app's default).
DEFAULT_MAX_MESSAGE_SIZE = {3: 128 * MiB, 4: 16 * MiB}
# 4.x checks a body against the copy it keeps in persistent_term; 3.x reads the application
# environment when a channel opens. The first that is set, else "undefined".
_MAX_MESSAGE_SIZE = (
    "case catch persistent_term:get(max_message_size) of N when is_integer(N) -> N; _ -> "
    "application:get_env(rabbit, max_message_size, undefined) end."
)


def _max_message_size(management: Management) -> int:
    """The broker's limit on a message body (4.x: 16 MiB by default; 3.10: 128 MiB)."""
    text = ctl(management, "eval", _MAX_MESSAGE_SIZE).strip()
    if text.isdigit():
        return int(text)
    assert text == "undefined", f"max_message_size: unexpected answer {text!r}"
    return DEFAULT_MAX_MESSAGE_SIZE[version(management)[0]]


def _refused(settings: Settings, size: int) -> bool:
    """Whether the broker refuses a body of ``size`` bytes (the channel closes)."""

    async def go() -> bool:
        connection = await aiormq.connect(settings.url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            try:
                await channel.basic_publish(b"\x00" * size, routing_key="nowhere")
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                return "larger than" in str(exc)
            return False
        finally:
            await connection.close()

    return bool(asyncio.run(go()))


def test_bad_bodies_park_invalid_with_the_reason_and_16_mib_bodies_go_through(
    fresh_vhost: Settings, worker: Worker, management: Management
) -> None:
    started = time.monotonic()
    # Bodies as large as the broker takes, up to 16 MiB: far above frame_max, so each travels
    # in 128 body frames each way. RabbitMQ 4.x refuses bodies above max_message_size (16 MiB
    # by default), so there they are exactly at the limit, and parking one proves that the
    # headers the worker adds do not count towards it (only the body does).
    limit = _max_message_size(management)
    size = min(16 * MiB, limit)
    if size == limit:  # the positive control: one byte more is refused
        assert _refused(fresh_vhost, limit + 1), (
            f"a body of {limit + 1} bytes was accepted: max_message_size is not {limit}")
    print(f"[reliability] max_message_size {limit} bytes; big bodies of {size} bytes")
    big_json = _json_of_size({"id": "big-json"}, "pad", size)
    big_binary = os.urandom(size)
    # Never valid UTF-8, so never JSON; and no zero byte among the first four, from which
    # json.loads would guess UTF-16 or UTF-32 and fail with another message (1 run in ~250).
    big_binary = b"\x80\x80\x80\x80" + big_binary[4:]
    big_order = _json_of_size({"amount": 7}, "id", size)
    publish_sync(fresh_vhost,
                 [Outgoing(f"o-{name}", body) for name, (body, _) in JSON_BODIES.items()]
                 + [Outgoing("o-big-json", big_json), Outgoing("o-big-binary", big_binary),
                    Outgoing("o-json-list", b"[1, 2]")], routing_key="rel.orders")
    publish_sync(fresh_vhost,
                 [Outgoing(f"t-{name}", body) for name, (body, _) in MODEL_BODIES.items()]
                 + [Outgoing("t-ok", b'{"id": "t-ok", "amount": 3}'), Outgoing("t-big", big_order)],
                 routing_key="rel.typed")
    parked = Parked(fresh_vhost)
    invalid = ({f"o-{n}" for n in JSON_BODIES} | {"o-big-binary"}
               | {f"t-{n}" for n in MODEL_BODIES})
    succeeded = {"o-big-json", "o-json-list", "t-ok", "t-big"}
    _settled(fresh_vhost, worker, parked, invalid | succeeded)

    assert ok_ids(worker.records) == succeeded
    assert set(parked.by_id) == invalid
    shown = {}
    for name, (body, message) in JSON_BODIES.items():
        copy = parked.one(f"o-{name}")
        assert copy.body == body
        assert copy.headers["parked-reason"] == "invalid"
        assert copy.headers["exception-type"] == "rabbit_retry.worker.consumer.InvalidPayload"
        assert copy.headers["exception-message"] == message
        shown[f"o-{name}"] = message
    copy = parked.one("o-big-binary")
    assert hashlib.sha256(copy.body).digest() == hashlib.sha256(big_binary).digest(), (
        f"the parked copy of the {size}-byte body differs: {len(copy.body)} bytes "
        f"(max_message_size {limit})")
    assert copy.headers["exception-message"] == (
        "body is not JSON: 'utf-8' codec can't decode byte 0x80 in position 0: invalid start "
        "byte")
    calls = _calls(worker)
    for name, (body, message) in MODEL_BODIES.items():
        copy = parked.one(f"t-{name}")
        assert copy.body == body
        assert copy.headers["parked-reason"] == "invalid"
        assert copy.headers["exception-type"] == "pydantic_core._pydantic_core.ValidationError"
        assert message in copy.headers["exception-message"]
        assert f"t-{name}" not in calls, "a body failing the model never reaches the handler"
    print(f"[reliability] bad bodies: {len(invalid)} parked invalid, {len(succeeded)} handled "
          f"(two of {size} bytes); {time.monotonic() - started:.1f}s")

    # What the operator sees: park them again and look with `parking show --json`.
    publish_sync(fresh_vhost,
                 [Outgoing(f"o-{name}", body) for name, (body, _) in JSON_BODIES.items()]
                 + [Outgoing("o-big-binary", big_binary)], routing_key="rel.orders")
    wait_for(lambda: total_depth(fresh_vhost, ["rel.orders.parking"]) == len(JSON_BODIES) + 1,
             "parked again")
    result = cli(fresh_vhost, "parking", "show", "rel.orders", "--json")
    assert result.code == 0, result.err
    view = {m["message_id"]: m for m in json.loads(result.out)["messages"]}
    for message_id, message in shown.items():
        assert view[message_id]["reason"] == "invalid"
        assert view[message_id]["exception_message"] == message
    assert view["o-big-binary"]["body_bytes"] == size, (
        f"parking show: {view['o-big-binary']['body_bytes']} bytes, published {size} "
        f"(max_message_size {limit})")
    assert total_depth(fresh_vhost, ["rel.orders.parking"]) == len(JSON_BODIES) + 1


# --- headers of the wrong types ------------------------------------------------------------


def _cases(queue: str) -> dict[str, dict[str, Any]]:
    return {
        "x-death-string": {"x-death": "rejected"},
        "x-death-table": {"x-death": {"queue": queue, "reason": "rejected", "count": 2}},
        "x-death-junk": {"x-death": ["junk", 7, None, [1, [2]],
                                     {"queue": {"nested": [1]}, "count": "x"}]},
        "count-string": {"x-death": [{"queue": queue, "reason": "rejected", "count": "1"}]},
        "count-words": {"x-death": [{"queue": queue, "reason": "rejected", "count": "two"}]},
        "count-negative": {"x-death": [{"queue": queue, "reason": "rejected", "count": -5}]},
        "count-table": {"x-death": [{"queue": queue, "reason": "rejected", "count": {"n": 1}}]},
        "count-huge": {"x-death": [{"queue": queue, "reason": "rejected", "count": 2**40}]},
        "retry-count-string": {"retry-count": "1"},
        "retry-count-table": {"retry-count": {"n": 1}},
        "retry-count-list": {"retry-count": [1, 2]},
        "retry-count-bool": {"retry-count": True},
        "retry-count-float": {"retry-count": 1.0},
        "retry-count-huge": {"retry-count": 2**40},
        "retry-count-binary": {"retry-count": b"\xff\xfe"},
        "retry-count-exhausted": {"retry-count": 9},
        "original-junk": {"original-exchange": 5, "original-routing-key": {"a": [None]}},
    }


def _as_delivered(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers as the worker will decode them (through the same wire codec)."""
    raw = pamqp_header.ContentHeader(
        0, 0, copy_properties(_props(), headers)).marshal()
    decoded = pamqp_header.ContentHeader()
    decoded.unmarshal(raw)
    return dict(decoded.properties.headers or {})


def _props() -> Any:
    from aiormq import spec

    return spec.Basic.Properties(message_id="m")


FAIL = 2  # the handler fails attempts 1 and 2 of every message of these tests


def _expected_path(first_attempt: int, max_attempts: int) -> tuple[list[int], str]:
    """Calls and end of a message whose handler fails attempts up to ``FAIL`` and that arrives
    as attempt ``first_attempt``: each retry is the next attempt, up to ``max_attempts``."""
    if first_attempt > max_attempts:
        return [], "exhausted"  # parked before the handler runs
    calls, attempt = [], first_attempt
    while True:
        calls.append(attempt)
        if attempt > FAIL:
            return calls, "ok"
        if attempt >= max_attempts:
            return calls, "exhausted"
        attempt += 1


def _check_headers(settings: Settings, worker: Worker, parked: Parked,
                   cases: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> Counter[str]:
    """Publish ``cases[queue][id] = headers``; check each message's calls and end."""
    for queue, by_id in cases.items():
        publish_sync(settings, [Outgoing(m, spec_body(m, fail=FAIL), h) for m, h in by_id.items()],
                routing_key=queue)
    ids = {m for by_id in cases.values() for m in by_id}
    _settled(settings, worker, parked, ids)
    calls, ok = _calls(worker), ok_ids(worker.records)
    ends: Counter[str] = Counter()
    for queue, by_id in cases.items():
        for message_id, headers in by_id.items():
            # Published straight to the queue: the route the worker believes its headers on.
            first = read(_as_delivered(headers), False, "", queue, queue).failures + 1
            want = _expected_path(first, QUEUES[queue])
            end = "ok" if message_id in ok else "exhausted"
            got = (calls.get(message_id, []), end)
            assert message_id not in ok or message_id not in parked.by_id, message_id
            if end == "exhausted":
                copy = parked.one(message_id)
                assert copy.headers["parked-reason"] == "exhausted", (message_id, copy.headers)
            if queue == "rel.orders" or "x-death" not in headers:
                assert got == want, (message_id, headers)
            else:
                # A client-written x-death that reaches the broker's own dead-lettering is
                # counted on by 3.x and ignored by 4.x: the first call and the bound hold.
                assert got[0][:1] == want[0][:1], (message_id, got, headers)
                assert len(got[0]) <= QUEUES[queue], (message_id, got, headers)
            ends[f"{queue}:{end}"] += 1
    return ends


def test_headers_of_the_wrong_types_count_as_the_rules_say(
    fresh_vhost: Settings, worker: Worker, dlx_guard: None
) -> None:
    started = time.monotonic()
    parked = Parked(fresh_vhost)
    cases = {q: {f"{q[4]}-{name}": h for name, h in _cases(q).items()}
             for q in ("rel.orders", "rel.payments")}
    ends = _check_headers(fresh_vhost, worker, parked, cases)
    calls = _calls(worker)
    # The hand-written cases, spelled out: digit strings count, anything else garbled is 0.
    assert calls["o-x-death-string"] == [1, 2, 3]
    assert calls["o-count-string"] == [2, 3]
    assert calls["o-retry-count-string"] == [2, 3]
    assert calls["o-retry-count-float"] == [2, 3]
    assert calls["o-retry-count-table"] == [1, 2, 3]
    assert calls["o-retry-count-huge"] == [1, 2, 3]
    assert "o-retry-count-exhausted" not in calls
    copy = parked.one("o-retry-count-exhausted")
    assert (copy.headers["parked-reason"], copy.headers["retry-count"]) == ("exhausted", 9)
    # On the native path (quorum, one tier) an x-death the broker would trip over, or one that
    # would count from a number we read as 0, takes the publish path instead; so does a message
    # that already carries a retry-count (the broker would count again from 1 below it).
    assert calls["p-x-death-junk"] == [1, 2, 3]
    assert calls["p-count-huge"] == [1, 2, 3]
    assert calls["p-count-negative"] == [1, 2, 3]
    assert calls["p-retry-count-string"] == [2, 3]
    print(f"[reliability] wrong-typed headers: {dict(ends)}; {time.monotonic() - started:.1f}s")

    # The operator's view of messages parked with junk headers still works.
    publish_sync(fresh_vhost, [Outgoing("o-junk-parked", spec_body("o-junk-parked", permanent=True),
                                   _cases("rel.orders")["x-death-junk"])],
            routing_key="rel.orders")
    wait_for(lambda: total_depth(fresh_vhost, ["rel.orders.parking"]) == 1, "parked")
    result = cli(fresh_vhost, "parking", "show", "rel.orders", "--json")
    assert result.code == 0, result.err
    [shown] = json.loads(result.out)["messages"]
    assert (shown["message_id"], shown["reason"]) == ("o-junk-parked", "permanent")


# No NaN or infinite doubles: RabbitMQ 3.10 cannot decode them and closes the publishing
# connection with INTERNAL_ERROR, so such a message never reaches a worker.
header_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["rejected", "expired", "delivery_limit", "3", "0", "rel.orders",
                       "rel.payments"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["queue", "reason", "count", "exchange", "routing-keys"])
        | st.text(max_size=10), children, max_size=5),
    max_leaves=15,
)
death = st.fixed_dictionaries({
    "queue": st.sampled_from(["rel.orders", "rel.payments", "other"]),
    "reason": st.sampled_from(["rejected", "expired", "delivery_limit", "maxlen"]),
    "count": st.integers(min_value=-3, max_value=6) | st.sampled_from(["1", "2", "x", b"1"]),
})
header_tables = st.dictionaries(
    st.sampled_from(["retry-count", "x-death", "original-exchange", "original-routing-key",
                     "x-first-death-queue", "x-first-death-exchange", "parked-reason"])
    | st.text(min_size=1, max_size=10),
    header_values | st.lists(death | header_values, max_size=3),
    max_size=5,
)


def test_fuzzed_headers_through_the_broker(
    fresh_vhost: Settings, worker: Worker, dlx_guard: None
) -> None:
    started = time.monotonic()
    parked = Parked(fresh_vhost)
    ends: Counter[str] = Counter()
    examples = 0

    @settings(max_examples=4, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(tables=st.lists(header_tables, min_size=8, max_size=8))
    def run(tables: list[dict[str, Any]]) -> None:
        nonlocal examples
        examples += 1
        cases = {q: {f"{q[4]}-h{examples}-{i}": h for i, h in enumerate(tables)}
                 for q in ("rel.orders", "rel.payments")}
        ends.update(_check_headers(fresh_vhost, worker, parked, cases))

    run()
    print(f"[reliability] fuzzed headers: {examples} examples, {sum(ends.values())} messages, "
          f"{dict(ends)}; {time.monotonic() - started:.1f}s")


# --- exceptions megabytes long -------------------------------------------------------------


NASTY = {
    "huge-message": "permanent",
    "huge-multibyte": "permanent",
    "deep-trace": "permanent",
    "huge-cause": "permanent",
    "surrogate": "permanent",
    "broken-str": "exhausted",  # not Permanent: retried, then parked exhausted
    "transient-huge": "exhausted",
}


def test_exceptions_megabytes_long_still_park_with_bounded_headers(
    fresh_vhost: Settings, worker: Worker
) -> None:
    started = time.monotonic()
    parked = Parked(fresh_vhost)
    publish_sync(fresh_vhost, [Outgoing(f"x-{kind}", spec_body(f"x-{kind}", **{"raise": kind}))
                          for kind in NASTY], routing_key="rel.orders")
    _settled(fresh_vhost, worker, parked, {f"x-{kind}" for kind in NASTY})
    calls = _calls(worker)
    for kind, reason in NASTY.items():
        headers = parked.one(f"x-{kind}").headers
        assert headers["parked-reason"] == reason, kind
        message = headers["exception-message"]
        trace = headers["exception-stacktrace"]
        assert len(message.encode()) <= 2048, kind
        assert len(trace.encode()) <= 8192, kind
        assert encoded_size(headers) < FRAME_MAX // 4, kind
        assert len(calls[f"x-{kind}"]) == (4 if reason == "exhausted" else 1), kind
    headers = {kind: parked.one(f"x-{kind}").headers for kind in NASTY}
    assert headers["huge-message"]["exception-message"].startswith("xxxx")
    assert "…[truncated 5242880 bytes]" in headers["huge-message"]["exception-message"]
    assert headers["huge-multibyte"]["exception-message"].startswith("é€😀\né€😀")
    assert "in _deep" in headers["deep-trace"]["exception-stacktrace"]
    assert headers["huge-cause"]["exception-message"] == "wrapped"
    assert "caused by ValueError: cause zzz" in headers["huge-cause"]["exception-stacktrace"]
    assert headers["broken-str"]["exception-message"] == "<str() failed: RuntimeError>"
    # A message that cannot be written as UTF-8 keeps its bad bytes visible, escaped.
    assert headers["surrogate"]["exception-message"] == "cannot open /data/\\udcff\\udcfe.csv"
    assert headers["transient-huge"]["exception-type"] == "rel_consumers.Transient"
    print(f"[reliability] huge exceptions: {len(NASTY)} parked with bounded headers; "
          f"{time.monotonic() - started:.1f}s")
