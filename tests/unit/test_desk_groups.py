"""Grouping parked messages by cause: what normalise keeps and replaces, and group_id."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rabbit_retry.desk.groups import MAX_LENGTH, PLACEHOLDERS, QUOTED_MAX, group_id, normalise

# (a message as a handler or library raises it, what an operator's group is titled by)
REAL_MESSAGES = [
    # Python exceptions
    ("order 123 not found", "order <n> not found"),
    ("'sku'", "'sku'"),  # str(KeyError('sku'))
    ("'NoneType' object has no attribute 'get'", "'NoneType' object has no attribute 'get'"),
    ("No module named 'app.handlers'", "No module named 'app.handlers'"),
    (
        "invalid literal for int() with base 10: '12a'",
        "invalid literal for int() with base <n>: '<n>a'",  # short quoted data splits
    ),
    ("list index out of range", "list index out of range"),
    ("division by zero", "division by zero"),
    (
        "<app.Order object at 0x7f3b2c1d0e10> is not JSON serializable",
        "<app.Order object at <hex>> is not JSON serializable",
    ),
    (
        "Expecting ',' delimiter: line 1 column 57 (char 56)",
        "Expecting ',' delimiter: line <n> column <n> (char <n>)",
    ),
    (
        "1 validation error for OrderCreated\namount_cents\n  Input should be a valid integer, "
        "unable to parse string as an integer [type=int_parsing, input_value='abc', "
        "input_type=str]\n    For further information visit "
        "https://errors.pydantic.dev/2.6/v/int_parsing",
        "<n> validation error for OrderCreated amount_cents Input should be a valid integer, "
        "unable to parse string as an integer [type=int_parsing, input_value=<str>, "
        "input_type=str] For further information visit https://errors.pydantic.dev/<n>/v/int_parsing",
    ),
    # HTTP clients
    (
        "Client error '404 Not Found' for url "
        "'https://api.example.com/v1/customers/cus_8842/orders/551?expand=items&token=abc'\n"
        "For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/404",
        "Client error '<n> Not Found' for url "
        "'https://api.example.com/v1/customers/cus_<n>/orders/<n>?<query>' "
        "For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/<n>",
    ),
    (
        "HTTPSConnectionPool(host='payments.internal', port=443): Max retries exceeded with url: "
        "/charges/ch_3MmlLrLkdIwHu7ix0snN0B15 (Caused by NewConnectionError('<urllib3.connection."
        "HTTPSConnection object at 0x7f1c2a3b4c50>: Failed to establish a new connection: "
        "[Errno 111] Connection refused'))",
        "HTTPSConnectionPool(host='payments.internal', port=<n>): Max retries exceeded with url: "
        "/charges/ch_<id> (Caused by NewConnectionError(<str>))",
    ),
    (
        "POST https://bob:s3cret@hooks.example.com/notify/42 returned 503",
        "POST https://hooks.example.com/notify/<n> returned <n>",
    ),
    # SQL
    (
        'duplicate key value violates unique constraint "orders_pkey"\n'
        "DETAIL:  Key (id)=(98213) already exists.",
        'duplicate key value violates unique constraint "orders_pkey" '
        "DETAIL: Key (id)=(<n>) already exists.",
    ),
    ('column "shipping_addr" does not exist', 'column "shipping_addr" does not exist'),
    (
        'connection to server at "10.0.3.7", port 5432 failed: Connection refused',
        'connection to server at "<ip>", port <n> failed: Connection refused',
    ),
    (
        "deadlock detected\nDETAIL:  Process 4711 waits for ShareLock on transaction 99812; "
        "blocked by process 4712.",
        "deadlock detected DETAIL: Process <n> waits for ShareLock on transaction <n>; "
        "blocked by process <n>.",
    ),
    # Timeouts and the worker's own
    ("timeout after 30s", "timeout after <n>s"),
    ("Timed out after 2.5 seconds waiting for 10.1.2.3:6379", "Timed out after <n> seconds "
     "waiting for <ip>:<n>"),
    (
        "returned to 'orders.fraud-check' 20 times without a verdict",
        "returned to 'orders.fraud-check' <n> times without a verdict",
    ),
    # Ids, times, addresses
    (
        "user 550e8400-e29b-41d4-a716-446655440000 (bob.smith+orders@example.co.uk) locked at "
        "2024-05-01T10:00:00.123Z, session from fe80::1ff:fe23:4567:890a",
        "user <id> (<email>) locked at <time>, session from <ip>",
    ),
    ("object 507f1f77bcf86cd799439011 is gone", "object <id> is gone"),
    ("job started 12:04:59 did not finish", "job started <time> did not finish"),
    # Not variable: versions glued to letters, words
    (
        "sha256 mismatch on utf8 input (HTTP/1.1, e2e)",
        "sha256 mismatch on utf8 input (HTTP/<n>, e2e)",
    ),
]


@pytest.mark.parametrize(("message", "expected"), REAL_MESSAGES)
def test_real_messages_normalise_to_their_cause(message: str, expected: str) -> None:
    assert normalise(message) == expected


SAME_CAUSE = [
    ("order 123 not found", "order 456 not found"),
    ("timeout after 30s", "timeout after 31s"),
    ("Client error '404 Not Found' for url 'https://api.example.com/orders/1?a=1'",
     "Client error '404 Not Found' for url 'https://api.example.com/orders/2?b=2'"),
    ("lock held by 550e8400-e29b-41d4-a716-446655440000",
     "lock held by 123e4567-e89b-12d3-a456-426614174000"),
    ("no reply from 10.0.0.1 since 2024-05-01T10:00:00Z",
     "no reply from 10.0.0.2 since 2024-05-02T11:30:01+02:00"),
    ("bounce for a@example.com", "bounce for someone.else@example.org"),
    ("bad payload 'x" + "a" * 80 + "'", "bad payload 'y" + "b" * 90 + "'"),
    ("a  b\n\tc", "a b c"),
]


@pytest.mark.parametrize(("one", "other"), SAME_CAUSE)
def test_same_cause_groups(one: str, other: str) -> None:
    assert normalise(one) == normalise(other)
    assert group_id("q", "E", one, reason="x") == group_id("q", "E", other, reason="x")


DIFFERENT_CAUSE = [
    ("'sku'", "'price'"),  # KeyError keys: the key is the cause
    ('column "sku" does not exist', 'column "price" does not exist'),
    ("Client error '404 Not Found'", "Server error '503 Service Unavailable'"),
    ("GET https://a.example.com/orders failed", "GET https://b.example.com/orders failed"),
    ("timeout after 30s", "timeout after 30ms"),
]


@pytest.mark.parametrize(("one", "other"), DIFFERENT_CAUSE)
def test_different_causes_stay_apart(one: str, other: str) -> None:
    assert normalise(one) != normalise(other)
    assert group_id("q", "E", one, reason="x") != group_id("q", "E", other, reason="x")


def test_quoted_values_are_kept_up_to_the_limit_then_replaced() -> None:
    assert normalise("'" + "k" * QUOTED_MAX + "'") == "'" + "k" * QUOTED_MAX + "'"
    assert normalise("'" + "k" * (QUOTED_MAX + 1) + "'") == "<str>"
    # Measured after its own numbers are replaced; a quoted URL is kept at any length.
    assert normalise("'" + "k " * 20 + "12345678901'") == "'" + "k " * 20 + "<n>'"
    url = "https://api.example.com/" + "segment/" * 20 + "7"
    assert normalise(f"for url '{url}'") == f"for url '{url[:-1]}<n>'"


def test_apostrophes_are_not_quotes() -> None:
    assert normalise("can't find user's order 12") == "can't find user's order <n>"


def test_length_is_bounded_and_never_cut_inside_a_placeholder() -> None:
    assert len(normalise("word " * 1000)) <= MAX_LENGTH
    # 'x' * 498 then a number: the cut would fall inside "<n>", so the placeholder goes whole.
    assert normalise("x" * 498 + " 7 tail") == "x" * 498
    assert normalise("y" * 496 + " 7 tail") == "y" * 496 + " <n>"


def test_missing_exception_still_groups_by_queue_and_reason() -> None:
    invalid = group_id("orders", None, None, reason="invalid")
    assert invalid == group_id("orders", "", "", reason="invalid")
    assert invalid != group_id("orders", None, None, reason="exhausted")
    assert invalid != group_id("orders.email", None, None, reason="invalid")
    assert group_id("orders", None, None, reason=None) == group_id("orders", "", "", reason="")


def test_every_part_of_the_id_counts_and_cannot_run_into_the_next() -> None:
    base = group_id("orders", "KeyError", "'sku'", reason="permanent")
    assert base != group_id("orders", "ValueError", "'sku'", reason="permanent")
    assert base != group_id("orders", "KeyError", "'sku'", reason="exhausted")
    # A separator-based key would make these two equal.
    assert group_id("a|b", "c", "", reason="r") != group_id("a", "b|c", "", reason="r")
    assert group_id("a", "b", "", reason="") != group_id("a\x00b", "", "", reason="")


def test_ids_are_pinned() -> None:
    """The same in every process and version: a change here means every stored group moves.

    Each is the first 16 hex digits of sha256('["orders.email","invalid","",""]') and so on,
    which `printf %s '...' | sha256sum` confirms outside Python.
    """
    assert group_id("orders.fraud-check", "KeyError", "'sku'", reason="permanent") == (
        "1a0d6de72c6a1585"
    )
    assert group_id("orders.email", None, None, reason="invalid") == "6b7be1b443e7a02d"


def test_ids_do_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "from rabbit_retry.desk.groups import group_id;"
        "print(group_id('orders', 'TimeoutError', 'timeout after 30s', reason='exhausted'))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {group_id("orders", "TimeoutError", "timeout after 30s", reason="exhausted")}


# Text that looks like what normalise works on, so the property tests reach its corners.
_PIECES = st.sampled_from(
    [" ", "  ", "\n", "'", '"', "<", ">", "0x", "123", "4.5", "ab", "f00d1234", "-", ":", "::",
     ".", "@", "example.com", "https://h/p?q=1", "2024-05-01T10:00:00Z", "12:00:00", "10.0.0.1",
     "_", "input_value=", ", input_type=", "n>", *PLACEHOLDERS]
)
_MESSAGES = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(blacklist_categories=())),  # surrogates included
    st.lists(_PIECES | st.text(max_size=3), max_size=60).map("".join),
)


@given(_MESSAGES)
@settings(max_examples=400, deadline=None)
def test_normalise_is_idempotent_bounded_and_total(message: str) -> None:
    once = normalise(message)
    assert normalise(once) == once
    assert len(once) <= MAX_LENGTH
    assert once == once.strip()
    assert "\n" not in once and "  " not in once


@given(st.text(max_size=40), st.text(max_size=20) | st.none(), _MESSAGES | st.none(),
       st.text(max_size=12) | st.none())
@settings(max_examples=200, deadline=None)
def test_group_id_is_stable_short_and_total(
    queue: str, kind: str | None, message: str | None, reason: str | None
) -> None:
    first = group_id(queue, kind, message, reason=reason)
    assert first == group_id(queue, kind, message, reason=reason)
    assert len(first) == 16 and int(first, 16) >= 0
    # The message counts through its normal form only.
    assert first == group_id(queue, kind, normalise(message or ""), reason=reason)


def test_a_long_message_normalises_quickly() -> None:
    # Unclosed quotes and long runs are the slow cases for regular expressions.
    for text in ("'" * 100_000, "a'" * 50_000, "1" * 100_000, "input_value=" * 10_000):
        assert len(normalise(text)) <= MAX_LENGTH


# --- identifiers of every common shape (issue 22: groups fell apart on letters+digits ids) ---

def test_letters_and_digits_ids_prefixed_and_quoted_are_one_cause() -> None:
    assert normalise("order ORD12345 not found") == "order <id> not found"
    assert normalise("'sku-AB00989'") == "'sku-<id>'"
    assert normalise("invoice INV-2024-00012 rejected") == "invoice INV-<n>-<n> rejected"
    assert normalise("user:u1234abc locked") == "user:<id> locked"
    # Words that carry a digit or three are not ids.
    for word in ("utf8", "sha256", "base64", "x509", "int32", "e2e", "ipv6", "h264"):
        assert normalise(f"bad {word} input") == f"bad {word} input"


def test_a_url_keeps_the_punctuation_around_it() -> None:
    assert normalise("x (api https://h/p?a=1)") == "x (api https://h/p?<query>)"
    assert normalise("x (api https://h/p)") == "x (api https://h/p)"
    assert normalise("see https://h/p/7.") == "see https://h/p/<n>."
    assert normalise("GET https://h/orders/(draft)/7, then") == (
        "GET https://h/orders/(draft)/<n>, then")
    assert normalise("'https://h/p?a=1'") == "'https://h/p?<query>'"


def test_a_thousand_sku_key_errors_are_one_group() -> None:
    import random

    rng = random.Random(22)
    ids = {
        group_id("orders", "KeyError",
                 repr(f"sku-{rng.choice('ABCDEFGHJK')}{rng.choice('XYZQRS')}{n:05d}"),
                 reason="permanent")
        for n in rng.sample(range(100_000), 1000)
    }
    assert len(ids) == 1


# Templates an application raises with, and identifiers of each shape a template takes.
_TEMPLATES = [
    "order {} not found",
    "KeyError: '{}'",
    "customer \"{}\" has no address",
    "lock on {} held by another worker",
    "POST https://api.example.com/v1/orders/{}/charge returned 503",
    "GET https://api.example.com/v1/orders/{}?expand=items failed",
    "cannot deliver to {}",
    "payment {} declined (card expired)",
]
_ALNUM = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnpqrstuvwxyz"


def _digits(low: int, high: int) -> st.SearchStrategy[str]:
    return st.text(alphabet="0123456789", min_size=low, max_size=high)


# Each strategy draws identifiers of one shape: any two of them must make one cause.
_SHAPES: list[st.SearchStrategy[str]] = [
    _digits(1, 12),  # numbers
    st.builds(lambda p, d: p + d, st.text(alphabet=_ALNUM, min_size=1, max_size=4),
              _digits(4, 10)),  # letters + digits: ORD12345
    *(st.builds(lambda d, p=prefix: p + d, _digits(1, 9))  # prefixed: sku-42, ord_7, user:9
      for prefix in ("sku-", "ord_", "cus_", "user:", "order/", "ch#")),
    st.builds(lambda a, d: f"sku-{a}{d}", st.text(alphabet="ABCDEFGHJK", min_size=1,
                                                   max_size=3), _digits(4, 8)),  # sku-AB00989
    st.uuids().map(str),
    st.uuids().map(lambda u: u.hex).filter(lambda h: not h.isdigit()),  # 32 hex digits
    st.binary(min_size=4, max_size=12).map(lambda b: "0x" + b.hex()),
    st.builds(lambda user, host: f"{user}@{host}.example.com",
              st.from_regex(r"[a-h]{1,4}(\.[a-h]{1,4})?", fullmatch=True),
              st.text(alphabet="abcdefgh", min_size=1, max_size=8)),
    *(st.builds(lambda q, p=path: f"https://h.example.com/{p}?id={q}", _digits(0, 6))
      for path in ("a", "b/c")),  # a URL's query (its path is the cause: it stays)
]


@given(st.sampled_from(_TEMPLATES),
       st.sampled_from(_SHAPES).flatmap(lambda shape: st.tuples(shape, shape)))
@settings(max_examples=500, deadline=None)
def test_one_template_with_any_identifiers_of_one_shape_is_one_cause(
    template: str, pair: tuple[str, str]
) -> None:
    """The same template filled with two identifiers of the same shape is one group."""
    one, other = pair
    assert normalise(template.format(one)) == normalise(template.format(other))


def test_operator_rules_replace_what_the_built_in_ones_keep() -> None:
    from rabbit_retry.desk.groups import Grouping, Rule

    grouping = Grouping([Rule(r"tenant [a-z]+", "tenant"), Rule(r"shard-\w+", "shard",
                                                                  queue="orders")])
    assert grouping.pattern("orders", "tenant acme over quota on shard-eu") == (
        "<tenant> over quota on <shard>")
    assert grouping.pattern("email", "tenant acme over quota on shard-eu") == (
        "<tenant> over quota on shard-eu")  # the shard rule is the orders queue's
    a = grouping.group("orders", "permanent", "QuotaError", "tenant acme over quota")
    b = grouping.group("orders", "permanent", "QuotaError", "tenant zeta over quota")
    assert a == b and a[1] == "<tenant> over quota"
    assert Grouping().group("orders", "permanent", "QuotaError", "tenant acme over quota") != a


@pytest.mark.parametrize(("pattern", "name", "says"), [
    ("(", "x", "pattern: not a regular expression: missing ), unterminated subpattern"),
    ("a*", "x", "pattern: matches an empty text (every message would change)"),
    ("a" * 201, "x", "pattern: at most 200 characters"),
    ("abc", "Bad Name", "name: 1 to 24 lowercase letters or _ (it becomes <name>)"),
    ("abc", "", "name: 1 to 24 lowercase letters or _ (it becomes <name>)"),
])
def test_a_rule_that_cannot_work_is_refused_in_one_line(pattern: str, name: str,
                                                        says: str) -> None:
    from rabbit_retry.desk.groups import Rule, check_rule
    from rabbit_retry.errors import InputError

    with pytest.raises(InputError) as caught:
        check_rule(Rule(pattern, name))
    assert str(caught.value).startswith(says), str(caught.value)
