"""Cross-reference rules: names, derived-name collisions, exchange references, queue arguments."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ruamel.yaml import YAML

from rabbit_retry.topology import parse_topology
from rabbit_retry.topology.check import Problem, check
from rabbit_retry.topology.model import TopologySpec


def spec(text: str) -> TopologySpec:
    return TopologySpec.model_validate(YAML(typ="safe").load(text))


def found(text: str) -> list[Problem]:
    return check(spec(text))


def one(text: str) -> Problem:
    [problem] = found(text)
    return problem


def queues(body: dict[str, Any], exchanges: str = "{orders: {type: topic}}") -> str:
    return f"version: 1\nexchanges: {exchanges}\nqueues: {json.dumps(body)}\n"


def test_a_clean_file_has_no_problems() -> None:
    assert found(queues({"a": {"bindings": [{"exchange": "orders"}]}, "b": {}})) == []


def test_an_exchange_and_a_queue_may_share_a_name() -> None:
    assert found(queues({"orders": {"bindings": [{"exchange": "orders"}]}})) == []


def test_problem_carries_the_key_path() -> None:
    problem = one(queues({"a": {"bindings": [{"exchange": "missing"}]}}))
    assert problem == Problem(
        ("queues", "a", "bindings", 0, "exchange"),
        "binding to exchange 'missing', which the file does not declare under exchanges",
    )


@pytest.mark.parametrize(
    ("names", "culprit", "message"),
    [
        (["a", "a.parking"], "a.parking", "collides with the parking queue of queue 'a'"),
        (["a.parking", "a"], "a.parking", "collides with the parking queue of queue 'a'"),
        (["a", "a.retry.30s"], "a.retry.30s", "collides with a retry tier of queue 'a'"),
        (
            ["a", "a.retry.2h"],
            "a.retry.2h",
            "inside the names reserved for the retry tiers of queue 'a' (a.retry.*)",
        ),
        (["a.b", "a.b.retry.x.y"], "a.b.retry.x.y", "retry tiers of queue 'a.b'"),
        (["a", "a.retry"], "a.retry", "would own names under 'a.retry.', which are reserved"),
    ],
)
def test_derived_name_collisions(names: list[str], culprit: str, message: str) -> None:
    problem = one(queues({n: {} for n in names}))
    assert problem.path == ("queues", culprit)
    assert message in problem.message


def test_lookalike_names_are_not_collisions() -> None:
    body: dict[str, Any] = {
        n: {} for n in ("a", "a-retry", "a.retrying", "b.retry.5s", "a.parking-lot", "parking")
    }
    assert found(queues(body)) == []


def test_exchange_named_like_a_retry_exchange() -> None:
    problem = one(queues({"a": {}}, exchanges="{a.retry: {type: direct}}"))
    assert problem.path == ("exchanges", "a.retry")
    assert "collides with the retry exchange of queue 'a'" in problem.message


def test_binding_to_a_retry_exchange_is_refused() -> None:
    problem = one(queues({"a": {}, "b": {"bindings": [{"exchange": "a.retry"}]}}))
    assert problem.message == (
        "'a.retry' is the retry exchange of queue 'a'; rabbit-retry binds it itself"
    )


@pytest.mark.parametrize(
    "exchange", ["amq.direct", "amq.fanout", "amq.headers", "amq.match", "amq.topic"]
)
def test_built_in_exchanges_need_no_declaration(exchange: str) -> None:
    assert found(queues({"a": {"bindings": [{"exchange": exchange}]}})) == []


def test_reserved_and_blank_names() -> None:
    text = 'version: 1\nexchanges: {amq.x: {type: topic}}\nqueues: {amq.q: {}, " ": {}}\n'
    assert [(p.path, p.message) for p in found(text)] == [
        (
            ("exchanges", "amq.x"),
            "exchange name 'amq.x': names starting with amq. are reserved by RabbitMQ",
        ),
        (
            ("queues", "amq.q"),
            "queue name 'amq.q': names starting with amq. are reserved by RabbitMQ",
        ),
        (("queues", " "), "a queue name must not be empty or blank"),
    ]


def test_the_lock_queues_name_is_reserved() -> None:
    problem = one(queues({"rabbit-retry.lock": {}}))
    assert problem.path == ("queues", "rabbit-retry.lock")
    assert problem.message == ("queue name rabbit-retry.lock is reserved: apply and migrate hold "
                               "a queue of that name while they change the vhost")
    assert found(queues({"rabbit-retry.locks": {}})) == []  # only that name


def test_name_lengths_follow_the_amqp_client_limits() -> None:
    # Q.retry must fit AMQP's 127-character exchange names: queue names stop at 121.
    assert found(queues({"q" * 121: {}}, exchanges="{" + "e" * 127 + ": {type: topic}}")) == []
    problem = one(queues({"q" * 122: {}}))
    assert problem.message == (
        "queue name is 122 characters long; at most 121 fit, so that its retry exchange "
        "(name + '.retry') stays within the 127 characters AMQP allows for an exchange name"
    )
    problem = one(queues({"a": {}}, exchanges="{" + "e" * 128 + ": {type: topic}}"))
    assert problem.message == "exchange name is 128 characters long; AMQP allows at most 127"


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("café", "'é'"),
        ("注文", "'文' '注'"),
        ("a\tb", "'\\t'"),
        ("a\u200bb", "'\\u200b'"),
        ("a*b", "'*'"),
        ("a|b;c", "';' '|'"),
    ],
)
def test_names_amqp_clients_cannot_send(name: str, shown: str) -> None:
    problem = one(queues({name: {}}))
    assert problem.message == (
        f"queue name {name!r} has characters AMQP clients cannot send ({shown}); names may hold "
        "letters A-Z a-z, digits, spaces and - _ . : @ # , / +"
    )
    problem = one(queues({"a": {}}, exchanges=f"{{{json.dumps(name)}: {{type: topic}}}}"))
    assert problem.path == ("exchanges", name)


def test_every_character_amqp_allows_is_allowed() -> None:
    # A space only in an exchange's name: a queue's is typed on command lines.
    name = "AZaz09-_.:@#,/+"
    exchange = f"{{{json.dumps(name + ' x')}: {{type: topic}}}}"
    assert found(queues({name: {}}, exchanges=exchange)) == []


def test_routing_key_length() -> None:
    assert (
        found(queues({"a": {"bindings": [{"exchange": "orders", "routing_key": "k" * 255}]}})) == []
    )
    problem = one(queues({"a": {"bindings": [{"exchange": "orders", "routing_key": "k" * 256}]}}))
    assert problem.path == ("queues", "a", "bindings", 0, "routing_key")


def test_duplicate_bindings_but_not_near_duplicates() -> None:
    b = {"exchange": "orders", "routing_key": "x"}
    near = [b, {**b, "routing_key": "y"}, {**b, "arguments": {"k": 1}}]
    assert found(queues({"a": {"bindings": near}})) == []
    problem = one(queues({"a": {"bindings": [*near, {**b, "arguments": {"k": 1}}]}}))
    assert (problem.path, problem.message) == (
        ("queues", "a", "bindings", 3),
        "the same binding as bindings[2]",
    )


@pytest.mark.parametrize(
    ("queue_type", "arguments", "message"),
    [
        ("quorum", {"x-dead-letter-routing-key": "x"}, "is managed: rabbit-retry routes dead"),
        ("classic", {"x-dead-letter-strategy": "at-least-once"}, "is managed"),
        ("classic", {"x-expires": 1000}, "is managed: an expiring main queue"),
        ("quorum", {"x-overflow": "reject-publish"}, "is managed: quorum queues need"),
        ("quorum", {"x-queue-mode": "lazy"}, "is not supported by quorum queues"),
        ("classic", {"x-delivery-limit": 5}, "is not supported by classic queues"),
        ("classic", {"x-quorum-initial-group-size": 3}, "is not supported by classic queues"),
        ("classic", {"x-overflow": "drop-tail"}, "must be one of drop-head, reject-publish"),
        ("classic", {"x-overflow": "reject-publish"}, "silently drops retried messages"),
        ("classic", {"x-max-priority": 256}, "must be a whole number 0-255, got 256"),
        ("quorum", {"x-max-length": "100"}, "must be a whole number >= 0, got '100'"),
        ("quorum", {"x-max-length-bytes": True}, "must be a whole number >= 0, got true"),
        ("quorum", {"x-quorum-initial-group-size": 0}, "must be a whole number >= 1, got 0"),
        ("quorum", {"x-single-active-consumer": 1}, "must be true or false, got 1"),
        (
            "quorum",
            {"custom": None},
            "must be a string, a number, true/false or a list of those, got null",
        ),
        ("quorum", {"custom": [1, {"a": 1}]}, "got [1, {'a': 1}]"),
        ("quorum", {"custom": 2**63}, "got a number too large for AMQP"),
    ],
)
def test_queue_arguments(queue_type: str, arguments: dict[str, Any], message: str) -> None:
    problem = one(queues({"a": {"queue_type": queue_type, "arguments": arguments}}))
    [key] = arguments
    assert problem.path == ("queues", "a", "arguments", key)
    assert message in problem.message


@pytest.mark.parametrize(
    ("queue_type", "arguments"),
    [
        ("classic", {"x-overflow": "reject-publish-dlx", "x-max-priority": 255}),
        ("classic", {"x-queue-mode": "lazy", "x-queue-version": 2}),
        ("classic", {"x-overflow": "drop-head", "x-max-length": 0, "on_full": "drop"}),
        ("quorum", {"x-delivery-limit": 20, "x-quorum-initial-group-size": 3}),
        ("quorum", {"x-single-active-consumer": False, "x-max-length-bytes": 10**9,
                    "on_full": "reject"}),
        ("quorum", {"x-custom": [1, "a", 1.5, True], "x-other": -(2**63)}),
    ],
)
def test_arguments_the_broker_accepts(queue_type: str, arguments: dict[str, Any]) -> None:
    # A length limit says what a full queue does (topology/limits.py), beside the arguments.
    arguments = dict(arguments)
    on_full = {k: arguments.pop(k) for k in ("on_full",) if k in arguments}
    assert found(queues({"a": {"queue_type": queue_type, "arguments": arguments,
                               **on_full}})) == []


def test_binding_and_exchange_arguments_are_checked_too() -> None:
    text = """\
version: 1
exchanges:
  e: {type: headers, arguments: {alternate-exchange: 5, x: ~}}
queues:
  a: {bindings: [{exchange: e, arguments: {x-match: {all: 1}}}]}
"""
    assert [p.path for p in found(text)] == [
        ("exchanges", "e", "arguments", "x"),
        ("exchanges", "e", "arguments", "alternate-exchange"),
        ("queues", "a", "bindings", 0, "arguments", "x-match"),
    ]


def test_check_runs_inside_the_loader_with_lines() -> None:
    text = "version: 1\nqueues:\n  a: {}\n  a.parking: {}\n"
    with pytest.raises(Exception) as excinfo:
        parse_topology(text, "f.yml")
    assert str(excinfo.value) == (
        "f.yml:4: queues.a.parking: queue 'a.parking' collides with the parking queue of queue 'a'"
    )


def test_delays_that_decrease_are_refused_and_repeats_are_kept() -> None:
    problem = one(queues({"a": {"retry": {"delays": ["5s", "1m", "5s"]}}}))
    assert (problem.path, problem.message) == (
        ("queues", "a", "retry", "delays", 2),
        "delays must not decrease: 5s comes after 1m; the n-th failure waits delays[n-1], so "
        "list them from the shortest",
    )
    text = "version: 1\ndefaults: {retry: {delays: [1m, 30s]}}\nqueues: {a: {}}\n"
    assert [p.path for p in found(text)] == [("defaults", "retry", "delays", 1)]
    # A repeat is a schedule: 5 s before the second and the third attempt, through one tier.
    assert found(queues({"a": {"retry": {"delays": ["5s", 5000, "1m", "1m"]}}})) == []


def test_queue_names_with_a_space_or_a_leading_dash_are_refused() -> None:
    assert one(queues({"my queue": {}})).message.startswith(
        "queue name 'my queue' has a space: a queue's name is typed on command lines"
    )
    assert one(queues({"-q": {}})).message.startswith(
        "queue name '-q' starts with -: on a command line (rabbit-retry parking show QUEUE) it "
        "reads as an option"
    )
    assert found(queues({"q-": {}, "q.-x": {}})) == []


def test_a_headers_binding_with_only_a_routing_key_is_refused() -> None:
    exchanges = "{h: {type: headers}, t: {type: topic}}"
    bad = [{"exchange": "h", "routing_key": "order.created"},
           {"exchange": "amq.match", "routing_key": "k", "arguments": {"x-match": "all"}}]
    problems = found(queues({"a": {"bindings": bad}}, exchanges=exchanges))
    assert [p.path for p in problems] == [
        ("queues", "a", "bindings", 0, "routing_key"),
        ("queues", "a", "bindings", 1, "routing_key"),
    ]
    assert problems[0].message == (
        "exchange 'h' is a headers exchange: it ignores routing_key, so with no header to match "
        "this binding takes every message; write the headers to match under arguments (with "
        "x-match: all or any), or drop routing_key to take every message"
    )
    good = [{"exchange": "h", "routing_key": "k", "arguments": {"kind": "order"}},
            {"exchange": "h"},  # no routing key: every message, as written
            {"exchange": "t", "routing_key": "order.created"}]
    assert found(queues({"a": {"bindings": good}}, exchanges=exchanges)) == []
