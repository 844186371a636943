"""Tunables as policies, without a broker: the schema and its one-line errors, the policy each
queue compiles to, the diff of policies, the notes on other policies, the worker's limit."""

from __future__ import annotations

import pytest

from rabbit_retry.broker.diff import applied_policies, diff, policy_notes
from rabbit_retry.broker.inspect import LivePolicy, LiveState
from rabbit_retry.errors import InputError
from rabbit_retry.topology import compile_topology, parse_topology
from rabbit_retry.topology.plan import Plan
from rabbit_retry.worker.redelivery import with_policy_limit

TOPOLOGY = """\
version: 1
queues:
  orders.email:
    queue_type: classic
    policy: {max_length: 1000, max_length_bytes: 1048576, overflow: drop-head, message_ttl: 1h}
    on_full: park
    on_expire: park
  pay+ments:
    policy: {delivery_limit: 7, priority: 20}
  plain: {}
"""


def _plan(text: str = TOPOLOGY) -> Plan:
    return compile_topology(parse_topology(text, "t.yml"))


def test_each_queue_with_tunables_gets_one_exactly_anchored_policy() -> None:
    email, payments = _plan().policies
    assert (email.name, email.pattern, email.priority, email.apply_to) == (
        "rabbit-retry:orders.email", r"^orders\.email$", 10, "queues"
    )
    assert email.definition == {
        "max-length": 1000, "max-length-bytes": 1048576, "overflow": "drop-head",
        "message-ttl": 3_600_000,
    }
    assert (payments.pattern, payments.definition, payments.priority) == (
        r"^pay\+ments$", {"delivery-limit": 7}, 20
    )


def test_tunables_never_touch_the_queue_arguments() -> None:
    email = next(q for q in _plan().queues if q.name == "orders.email")
    assert "x-max-length" not in email.arguments and "x-message-ttl" not in email.arguments


@pytest.mark.parametrize(("queue", "policy", "message"), [
    ("queue_type: classic", "{delivery_limit: 3}",
     "queues.q.policy.delivery_limit: classic queues have no delivery limit"),
    ("queue_type: quorum", "{overflow: drop-head}",
     "queues.q.policy.overflow: quorum queues need reject-publish for at-least-once "
     "dead letters; rabbit-retry sets it"),
    ("queue_type: classic", "{overflow: reject-publish}",
     "queues.q.policy.overflow: reject-publish on a classic queue silently drops retried "
     "messages that return while the queue is full"),
    ("queue_type: classic", "{max_length: -1}",
     "queues.q.policy.max_length: must be at least 0, got -1"),
    ("queue_type: classic", "{overflow: sometimes}",
     "queues.q.policy.overflow: expected 'drop-head', 'reject-publish' or "
     "'reject-publish-dlx', got 'sometimes'"),
    ("queue_type: classic", "{max_lenght: 3}",
     "queues.q.policy.max_lenght: unknown key 'max_lenght'; did you mean 'max_length'? "
     "(allowed: max_length, max_length_bytes, overflow, delivery_limit, message_ttl, priority)"),
    ("queue_type: classic", "{message_ttl: soon}",
     "queues.q.policy.message_ttl: bad duration 'soon': write a whole number and a unit "
     "(250ms, 5s, 2m, 1h, 1d) or an integer of milliseconds"),
])
def test_bad_tunables_are_one_line_naming_the_key(queue: str, policy: str, message: str) -> None:
    text = f"version: 1\nqueues:\n  q:\n    {queue}\n    policy: {policy}\n"
    with pytest.raises(InputError) as caught:
        parse_topology(text, "t.yml")
    assert str(caught.value) == f"t.yml:5: {message}"


def test_a_tunable_also_set_as_an_argument_is_refused() -> None:
    text = ("version: 1\nqueues:\n  q:\n    queue_type: classic\n"
            "    arguments: {x-max-length: 5}\n    policy: {max_length: 5}\n")
    with pytest.raises(InputError) as caught:
        parse_topology(text, "t.yml")
    assert "queues.q.policy.max_length: also set as argument 'x-max-length'; set it once" in str(
        caught.value
    )


def _live(*policies: LivePolicy) -> LiveState:
    return LiveState(queues={}, exchanges={}, bindings=(), policies=policies)


def _ours(name: str, definition: dict[str, object], priority: int = 10) -> LivePolicy:
    return LivePolicy(f"rabbit-retry:{name}", "^" + name.replace(".", "\\.") + "$", "queues",
                      definition, priority)


def test_policies_are_created_updated_and_left_alone() -> None:
    plan = _plan()
    changes = [c for c in diff(plan, _live()) if c.object == "policy"]
    assert [(c.kind, c.name) for c in changes] == [
        ("create", "rabbit-retry:orders.email"), ("create", "rabbit-retry:pay+ments")
    ]
    email = _ours("orders.email", {"max-length": 1000, "max-length-bytes": 1048576,
                                   "overflow": "drop-head", "message-ttl": 3_600_000})
    payments = LivePolicy("rabbit-retry:pay+ments", r"^pay\+ments$", "queues",
                          {"delivery-limit": 5}, 20)
    changes = [c for c in diff(plan, _live(email, payments)) if c.object == "policy"]
    assert [(c.kind, c.name) for c in changes] == [
        ("unchanged", "rabbit-retry:orders.email"), ("update", "rabbit-retry:pay+ments")
    ]
    assert changes[1].detail == (
        "live {delivery-limit: 5} priority 20, file {delivery-limit: 7} priority 20"
    )


def test_a_policy_the_file_no_longer_sets_is_deleted_and_others_are_not_ours() -> None:
    plan = _plan(TOPOLOGY.replace("    policy: {delivery_limit: 7, priority: 20}\n", ""))
    stale = LivePolicy("rabbit-retry:pay+ments", r"^pay\+ments$", "queues", {}, 20)
    foreign = LivePolicy("rabbit-retry:elsewhere", "^elsewhere$", "queues", {}, 1)
    changes = [c for c in diff(plan, _live(stale, foreign)) if c.object == "policy"]
    others = [(c.kind, c.name, c.detail) for c in changes
              if c.name != "rabbit-retry:orders.email" and not c.orphan]
    assert others == [
        ("update", "rabbit-retry:pay+ments", "no longer in the file: deleted")
    ]
    # The policy of a queue the file does not declare is an orphan: reported, left to prune.
    [orphan] = [c for c in changes if c.orphan]
    assert (orphan.kind, orphan.name, orphan.owner) == (
        "prune", "rabbit-retry:elsewhere", "elsewhere")


def test_notes_say_which_other_policy_wins_or_loses_and_name_operator_policies() -> None:
    plan = _plan()
    live = _live(
        LivePolicy("ha-all", ".*", "all", {"max-length": 5}, 50),
        LivePolicy("tiny", "^orders", "queues", {"max-length": 1}, 1),
        LivePolicy("same", "email$", "queues", {"expires": 1}, 10),
        LivePolicy("exchanges-only", ".*", "exchanges", {"alternate-exchange": "x"}, 99),
        LivePolicy("cap", ".*", "queues", {"max-length": 10}, 0, operator=True),
    )
    notes = policy_notes(plan, live)
    email = [n for n in notes if "queue orders.email" in n]
    assert email == [
        "policy ha-all (priority 50, max-length) wins over rabbit-retry:orders.email (priority "
        "10) on queue orders.email: the file's tunables do not apply; raise policy.priority or "
        "change that policy",
        "policy same has the same priority (10) as rabbit-retry:orders.email on queue "
        "orders.email: which one applies is up to the broker; give policy.priority another value",
        "policy tiny (priority 1, max-length) loses to rabbit-retry:orders.email (priority 10) "
        "on queue orders.email: its keys no longer apply there",
        "operator policy cap (max-length) also applies to queue orders.email: where both set a "
        "limit, the lower one wins",
    ]
    assert not any("queue plain" in n for n in notes)  # no tunables: nothing of ours to lose


def test_the_policy_that_applies_to_each_queue_is_ours_or_the_one_that_wins() -> None:
    plan = _plan()
    email = _ours("orders.email", {"max-length": 1000})
    payments = _ours("pay+ments", {"delivery-limit": 7}, 20)
    payments = LivePolicy(payments.name, "^pay\\+ments$", "queues", payments.definition, 20)
    ha_all = LivePolicy("ha-all", ".*", "all", {"max-length": 5}, 15)
    same = LivePolicy("same", "ments$", "queues", {"expires": 1}, 20)
    cap = LivePolicy("cap", ".*", "queues", {"max-length": 10}, 0, operator=True)
    quorum_only = LivePolicy("q", ".*", "quorum_queues", {"x": 1}, 99)  # orders.email: classic
    applied = applied_policies(plan, _live(email, payments, ha_all, same, cap, quorum_only))

    loses = applied["orders.email"]
    assert loses.policy == ha_all and not loses.ours_applies
    assert loses.warning == (
        "orders.email: policy ha-all (priority 15) wins over rabbit-retry:orders.email "
        "(priority 10): the file's tunables do not apply"
    )
    assert loses.to_json() == {
        "name": "ha-all", "priority": 15, "definition": {"max-length": 5}, "tied": [],
        "operator_policy": "cap", "operator_definition": {"max-length": 10},
        "ours": "rabbit-retry:orders.email", "ours_applies": False,
    }
    tie = applied["pay+ments"]  # quorum: "q" (99) matches it and wins
    assert tie.policy == quorum_only and tie.warning is not None
    assert tie.warning.startswith("pay+ments: policy q (priority 99) wins over ")

    # Without the others, ours applies; a tie is the broker's pick; no block, no warning.
    applied = applied_policies(plan, _live(email, payments, same, cap))
    assert applied["orders.email"].ours_applies and applied["orders.email"].warning is None
    tie = applied["pay+ments"]
    assert tie.policy is None and [p.name for p in tie.top] == ["rabbit-retry:pay+ments", "same"]
    assert tie.warning == (
        "pay+ments: policy same has the same priority (20) as rabbit-retry:pay+ments: the "
        "broker applies one of them"
    )
    assert tie.to_json()["tied"] == ["rabbit-retry:pay+ments", "same"]
    plain = applied["plain"]
    assert (plain.ours, plain.policy, plain.operator, plain.warning) == (None, None, cap, None)
    # Ours not on the broker yet: drift (apply sets it), not a warning.
    applied = applied_policies(plan, _live(ha_all))
    assert applied["orders.email"].ours_live is None and applied["orders.email"].warning is None


def test_the_worker_sees_the_files_policy_limit_the_lower_of_two_winning() -> None:
    assert with_policy_limit({}, {"delivery-limit": 7}) == {"x-delivery-limit": 7}
    assert with_policy_limit({"x-delivery-limit": 3}, {"delivery-limit": 7}) == {
        "x-delivery-limit": 3
    }
    assert with_policy_limit({"x-delivery-limit": 9}, {"delivery-limit": 7}) == {
        "x-delivery-limit": 7
    }
    assert with_policy_limit({"a": 1}, {}) == {"a": 1}
