"""The loader: YAML text -> Topology, defaults merged, every problem one line with its place."""

from __future__ import annotations

from pathlib import Path

import pytest

from rabbit_retry.errors import EXIT_INPUT, InputError
from rabbit_retry.topology import RetryPolicy, load, load_topology, parse_topology
from rabbit_retry.topology.load import MAX_FILE_BYTES, TopologyError
from rabbit_retry.topology.model import DEFAULT_DELAYS_MS, DEFAULT_MAX_ATTEMPTS


def problems(text: str, source: str = "t.yml") -> list[str]:
    with pytest.raises(TopologyError) as excinfo:
        parse_topology(text, source)
    error = excinfo.value
    assert isinstance(error, InputError)
    assert error.exit_code == EXIT_INPUT == 2
    assert str(error) == "\n".join(error.lines)
    for line in error.lines:
        assert line.startswith(f"{source}:")
        assert "\n" not in line and "Traceback" not in line
    return error.lines


def test_defaults_merge_into_every_queue_key_by_key() -> None:
    topology = parse_topology(
        """\
version: 1
defaults:
  queue_type: classic
  retry: {delays: [1s, 10s], max_attempts: 4}
queues:
  a: {}
  b: {retry: {max_attempts: 2}}
  c: {queue_type: quorum, retry: {delays: [3s]}}
"""
    )
    a, b, c = (topology.queue(n) for n in ("a", "b", "c"))
    assert (a.queue_type, a.retry.delays_ms, a.retry.max_attempts) == ("classic", (1000, 10000), 4)
    assert (b.queue_type, b.retry.delays_ms, b.retry.max_attempts) == ("classic", (1000, 10000), 2)
    assert (c.queue_type, c.retry.delays_ms, c.retry.max_attempts) == ("quorum", (3000,), 4)


def test_built_in_defaults_when_the_file_says_nothing() -> None:
    queue = parse_topology("version: 1\nqueues:\n  work:\n").queue("work")
    assert queue.queue_type == "quorum"
    assert queue.retry.delays_ms == DEFAULT_DELAYS_MS == (5_000, 30_000, 300_000)
    assert queue.retry.max_attempts == DEFAULT_MAX_ATTEMPTS == 5
    assert queue.bindings == () and dict(queue.arguments) == {}


def test_exchanges_bindings_and_arguments_are_kept() -> None:
    topology = parse_topology(
        """\
version: 1
exchanges:
  orders: {type: topic}
  hdr: {type: headers, durable: false, auto_delete: true, internal: true}
queues:
  q:
    bindings:
      - {exchange: orders, routing_key: "order.*"}
      - {exchange: hdr, arguments: {x-match: any, kind: a}}
    arguments: {x-max-length: 10}
    on_full: reject
""",
        "orders.yml",
    )
    assert topology.source == "orders.yml"
    assert [(e.name, e.type, e.durable, e.auto_delete, e.internal) for e in topology.exchanges] == [
        ("orders", "topic", True, False, False),
        ("hdr", "headers", False, True, True),
    ]
    q = topology.queue("q")
    assert [(b.exchange, b.routing_key, dict(b.arguments)) for b in q.bindings] == [
        ("orders", "order.*", {}),
        ("hdr", "", {"x-match": "any", "kind": "a"}),
    ]
    assert dict(q.arguments) == {"x-max-length": 10}
    assert topology.queue_names == ("q",)
    with pytest.raises(KeyError):
        topology.queue("nope")


def test_retry_policy_delay_for_each_failure() -> None:
    policy = (
        parse_topology(
            "version: 1\nqueues:\n  q: {retry: {delays: [5s, 30s, 5m], max_attempts: 6}}\n"
        )
        .queue("q")
        .retry
    )
    assert [policy.delay_for(f) for f in (1, 2, 3, 4, 5)] == [5_000, 30_000, 300_000] + [
        300_000
    ] * 2
    assert policy.delay_for(0) == 5_000  # nonsense input never indexes out of range
    assert policy.tiers_ms == (5_000, 30_000, 300_000)


def test_retry_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(delays_ms=(), max_attempts=3)
    with pytest.raises(ValueError):
        RetryPolicy(delays_ms=(0,), max_attempts=3)
    with pytest.raises(ValueError):
        RetryPolicy(delays_ms=(5,), max_attempts=0)


def test_a_problem_names_file_line_and_key() -> None:
    text = """\
version: 1
queues:
  orders.email:
    retry:
      delays: [5s, 1.5s]
"""
    assert problems(text, "topologies/orders.yml") == [
        "topologies/orders.yml:5: queues.orders.email.retry.delays[1]: bad duration '1.5s': "
        "write a whole number and a unit (250ms, 5s, 2m, 1h, 1d) or an integer of milliseconds"
    ]


def test_list_items_point_at_their_own_line() -> None:
    text = """\
version: 1
exchanges: {e: {type: topic}}
queues:
  q:
    bindings:
      - exchange: e
        routing_key: a
      - exchange: e
        routing_key: 7
"""
    assert problems(text) == [
        "t.yml:9: queues.q.bindings[1].routing_key: expected a string, got 7; quote it"
    ]


def test_every_problem_is_reported_in_file_order() -> None:
    text = """\
version: 1
queues:
  b:
    retry: {max_attempts: 0}
  a:
    queue_type: lazy
    colour: red
"""
    assert problems(text) == [
        "t.yml:4: queues.b.retry.max_attempts: must be at least 1, got 0",
        "t.yml:6: queues.a.queue_type: expected 'quorum' or 'classic', got 'lazy'",
        "t.yml:7: queues.a.colour: unknown key 'colour' (allowed: queue_type, bindings, retry, "
        "parking, replicas, arguments, policy, ordered, on_full, on_expire, renamed_from)",
    ]


def test_schema_problems_come_before_cross_reference_checks() -> None:
    # A dangling exchange is only looked for once the file's shape is right.
    text = "version: 1\nqueues:\n  q: {bindings: [{exchange: nope}], retry: {delays: []}}\n"
    assert problems(text) == ["t.yml:3: queues.q.retry.delays: must not be empty"]


def test_unknown_key_suggests_the_near_miss() -> None:
    text = "version: 1\nqueues:\n  q:\n    retries: {max_attempts: 2}\n"
    assert problems(text) == [
        "t.yml:4: queues.q.retries: unknown key 'retries'; did you mean 'retry'? (allowed: "
        "queue_type, bindings, retry, parking, replicas, arguments, policy, ordered, on_full, "
        "on_expire, renamed_from)"
    ]


def test_duplicate_keys_name_both_lines() -> None:
    text = """\
version: 1
queues:
  q:
    retry: {max_attempts: 2}
  r: {}
  q:
    retry: {max_attempts: 3}
"""
    assert problems(text) == ["t.yml:6: queues.q: duplicate key, first defined on line 3"]


def test_keys_that_are_not_names() -> None:
    text = "version: 1\nqueues:\n  404: {}\n  2024-01-01: {}\n  ~: {}\n  ? [a]\n  : {}\n"
    assert problems(text) == [
        "t.yml:3: queues: key 404 reads as a number, not a name; quote it: '404'",
        "t.yml:4: queues: key 2024-01-01 reads as a date, not a name; quote it: '2024-01-01'",
        "t.yml:5: queues: a key is empty (null); write a name",
        "t.yml:6: queues: a key must be a name, not a list or a mapping",
    ]


def test_version_is_exactly_the_integer_one() -> None:
    for written, shown in [("2", "2"), ("true", "true"), ("1.0", "1.0"), ("'2'", "'2'")]:
        assert problems(f"version: {written}\nqueues: {{q: {{}}}}\n") == [
            f"t.yml:1: version: unsupported version {shown}; this tool reads version: 1"
        ]
    for written in ("'1'", '"1"'):
        assert problems(f"version: {written}\nqueues: {{q: {{}}}}\n") == [
            "t.yml:1: version: must be the integer 1, not the string '1'; write version: 1 "
            "without quotes"
        ]


def test_strict_types_never_coerce() -> None:
    text = """\
version: 1
exchanges:
  e: {type: direct, durable: "true"}
queues:
  q: {retry: {max_attempts: 2.0}}
"""
    assert problems(text) == [
        "t.yml:3: exchanges.e.durable: expected true or false, got 'true'",
        "t.yml:5: queues.q.retry.max_attempts: expected a whole number, got 2.0",
    ]


def test_null_reads_as_the_default() -> None:
    topology = parse_topology(
        "version: 1\ndefaults:\nexchanges:\nqueues:\n  q:\n"
        "    retry: {delays: ~, max_attempts: 2}\n    bindings:\n    arguments:\n"
    )
    queue = topology.queue("q")
    assert queue.retry == RetryPolicy(delays_ms=DEFAULT_DELAYS_MS, max_attempts=2)
    assert topology.exchanges == ()


def test_null_is_still_wrong_where_a_value_is_required() -> None:
    text = "version: 1\nexchanges:\n  e: {type: ~}\nqueues:\n  q: {bindings: [{exchange: ~}]}\n"
    assert problems(text) == [
        "t.yml:3: exchanges.e.type: expected 'direct', 'topic', 'fanout' or 'headers', got null",
        "t.yml:5: queues.q.bindings[0].exchange: expected a string, got null",
    ]


def test_merge_keys_written_keys_win() -> None:
    topology = parse_topology(
        """\
version: 1
queues:
  a: &base
    queue_type: classic
    retry: {delays: [2s], max_attempts: 2}
  b:
    <<: *base
    retry: {max_attempts: 7}
"""
    )
    b = topology.queue("b")
    assert b.queue_type == "classic"
    assert b.retry == RetryPolicy(delays_ms=DEFAULT_DELAYS_MS, max_attempts=7)


def test_a_flaw_in_merged_keys_points_at_the_anchor() -> None:
    text = """\
version: 1
queues:
  a: &base
    retry: {max_attempts: 2}
  b:
    <<: *base
    queue_type: classic
  c:
    <<: [*base]
    bogus: 1
"""
    assert problems(text) == [
        "t.yml:10: queues.c.bogus: unknown key 'bogus' (allowed: queue_type, bindings, retry, "
        "parking, replicas, arguments, policy, ordered, on_full, on_expire, renamed_from)"
    ]


def test_alias_bomb_is_refused_not_expanded() -> None:
    lines = ["version: 1", "x0: &x0 [a, a, a, a, a, a, a, a, a, a]"]
    for i in range(1, 8):
        lines.append(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 10) + "]")
    lines.append("queues: {q: {}}")
    [line] = problems("\n".join(lines) + "\n")
    assert line.startswith("t.yml:2: the file is too large: more than 100000 values (check its "
                           "anchors and aliases)")


def test_deep_nesting_is_refused() -> None:
    text = "version: 1\nqueues:\n  q:\n    arguments:\n      x: " + "[" * 100 + "]" * 100 + "\n"
    [line] = problems(text)
    assert line.startswith("t.yml:5: the file is too large: nested more than 64 levels deep")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "t.yml:1: the file is empty; expected a mapping with version: 1"),
        ("# only a comment\n", "t.yml:1: the file is empty; expected a mapping with version: 1"),
        ("[1, 2]\n", "t.yml:1: expected a mapping with version: 1 at the top level, got a list"),
        (
            "just words\n",
            "t.yml:1: expected a mapping with version: 1 at the top level, got 'just words'",
        ),
        ("version: 1\nqueues:\n  q: {\n", "t.yml:4: not valid YAML: "),
        (
            "version: 1\nqueues:\n\tq: {}\n",
            "t.yml:3: not valid YAML: found character '\\t' that "
            "cannot start any token; indent with spaces, not tabs",
        ),
        (
            "version: 1\nqueues:\n  q: \x07\n",
            "t.yml:3: not valid YAML: character #x0007 is not allowed",
        ),
    ],
)
def test_text_that_is_not_a_topology(text: str, expected: str) -> None:
    [line] = problems(text)
    assert line.startswith(expected)


def test_load_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "t.yml"
    path.write_text("version: 1\nqueues: {q: {}}\n", encoding="utf-8")
    topology = load_topology(path)
    assert topology.queue_names == ("q",)
    assert topology.source == str(path)


def test_load_names_the_file_it_cannot_read(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yml"
    with pytest.raises(TopologyError) as excinfo:
        load_topology(missing)
    assert excinfo.value.lines == [f"{missing}: no such file"]
    with pytest.raises(TopologyError) as excinfo:
        load_topology(tmp_path)
    assert excinfo.value.lines == [f"{tmp_path}: is a directory, not a topology file"]


def test_load_points_at_the_line_with_the_bad_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yml"
    path.write_bytes(b"version: 1\nqueues:\n  caf\xe9: {}\n")
    with pytest.raises(TopologyError) as excinfo:
        load_topology(path)
    assert excinfo.value.lines == [
        f"{path}:3: not UTF-8 text: byte 0xe9 cannot be decoded (invalid continuation byte)"
    ]
    assert excinfo.value.exit_code == 2


def test_a_byte_order_mark_and_crlf_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "win.yml"
    path.write_bytes(b"\xef\xbb\xbfversion: 1\r\nqueues:\r\n  q: {}\r\n")
    assert load_topology(path).queue_names == ("q",)


def test_a_reused_anchor_is_fine_and_prints_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    topology = parse_topology(
        """\
version: 1
queues:
  a: {retry: &r {max_attempts: 2}}
  b: {retry: &r {max_attempts: 3}}
  c: {retry: *r}
"""
    )
    assert topology.queue("c").retry.max_attempts == 3
    assert not recwarn.list


def test_replicas_on_a_queue_without_a_quorum_queue_is_one_line() -> None:
    text = ("version: 1\nqueues:\n  q:\n    queue_type: classic\n    replicas: 3\n")
    assert problems(text) == [
        "t.yml:5: queues.q.replicas: replicas applies to quorum queues; this queue and its "
        "parking queue are classic"
    ]


def test_replicas_and_the_argument_together_are_refused() -> None:
    text = ("version: 1\nqueues:\n  q:\n    replicas: 3\n"
            "    arguments: {x-quorum-initial-group-size: 3}\n")
    assert problems(text) == [
        "t.yml:5: queues.q.arguments.x-quorum-initial-group-size: set replicas instead (it also "
        "reaches the retry tiers and a quorum parking queue); not both"
    ]


@pytest.mark.parametrize("body, message", [
    ("parking: {queue_type: stream}",
     "queues.q.parking.queue_type: expected 'quorum' or 'classic', got 'stream'"),
    ("replicas: 0", "queues.q.replicas: must be at least 1, got 0"),
    ("parking: {type: quorum}",
     "queues.q.parking.type: unknown key 'type'; did you mean 'queue_type'? (allowed: "
     "queue_type)"),
])
def test_bad_parking_and_replicas_keys_are_one_line(body: str, message: str) -> None:
    assert problems(f"version: 1\nqueues:\n  q:\n    {body}\n") == [f"t.yml:4: {message}"]


def test_defaults_replicas_skip_queues_without_a_quorum_queue() -> None:
    text = ("version: 1\ndefaults: {replicas: 2}\nqueues:\n  a: {}\n"
            "  b: {queue_type: classic}\n")
    topology = parse_topology(text, "t.yml")
    assert [q.replicas for q in topology.queues] == [2, 2]
    assert [q.parking_type for q in topology.queues] == ["quorum", "classic"]


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    # 5 MB of what would be valid queues: refused on its size alone, with that reason.
    path = tmp_path / "huge.yml"
    body = "".join(f"  q{i}: {{retry: {{delays: [5s, 30s]}}}}\n" for i in range(160_000))
    path.write_text("version: 1\nqueues:\n" + body)
    assert path.stat().st_size > 5_000_000
    with pytest.raises(TopologyError) as excinfo:
        load_topology(path)
    assert excinfo.value.lines == [
        f"{path}: the file is larger than 1 MiB (1048576 bytes), the most a topology file may "
        "hold; is it the right file?"
    ]
    assert problems("version: 1\nqueues:\n" + body) == [
        "t.yml: the file is larger than 1 MiB (1048576 bytes), the most a topology file may "
        "hold; is it the right file?"
    ]
    # A file just under the limit is read (positive control; mostly a comment, cheap to parse).
    head = "version: 1\nqueues: {q: {}}\n# "
    fits = tmp_path / "fits.yml"
    fits.write_text(head + "x" * (MAX_FILE_BYTES - len(head)))
    assert fits.stat().st_size == MAX_FILE_BYTES
    assert load_topology(fits).queue_names == ("q",)


def test_too_many_values_mention_anchors_only_when_the_file_has_aliases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(load, "MAX_VALUES", 40)
    plain = "version: 1\nqueues:\n  q:\n    arguments:\n      x: [" + "1, " * 40 + "1]\n"
    assert problems(plain) == ["t.yml:5: the file is too large: more than 40 values"]
    aliased = "version: 1\nqueues:\n  q:\n    arguments:\n      x: &a [1, 2]\n      y: *a\n"
    aliased += "      z: [" + "1, " * 40 + "1]\n"
    assert problems(aliased) == [
        "t.yml:7: the file is too large: more than 40 values (check its anchors and aliases)"
    ]
