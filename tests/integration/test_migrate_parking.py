"""``rabbit-retry migrate`` of a parking queue holding messages on a real broker: a file that
asks for quorum parking (docs/cluster.md) where the live parking queue is classic, and back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from support.amqp import blocking, depth_sync, drain_sync, persistent, publish_stream

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

Q = "migp.orders"
PARKING = f"{Q}.parking"
PARKED = 500


def _file(parking_type: str) -> str:
    return f"""\
version: 1
exchanges:
  shop: {{type: topic}}
queues:
  {Q}:
    bindings: [{{exchange: shop, routing_key: "order.*"}}]
    retry: {{delays: [1h], max_attempts: 3}}
    parking: {{queue_type: {parking_type}}}
"""


def _write(tmp_path: Path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _type(management: Management, settings: Settings, queue: str) -> str:
    info = management.queue(settings.vhost, queue)
    assert info is not None, queue
    return str(info["type"])


def _park(settings: Settings, count: int, prefix: str) -> None:
    blocking(publish_stream(
        settings, PARKING, count,
        lambda i: persistent(b'{"n": 1}', message_id=f"{prefix}-{i}",
                             headers={"parked-reason": "exhausted", "retry-count": 3}),
    ))


def test_a_classic_parking_queue_becomes_quorum_and_back_with_every_parked_message_once(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: Callable[..., object]
) -> None:
    classic = _write(tmp_path, _file("classic"), "classic.yml")
    assert run_cli("apply", classic, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]
    _park(fresh_vhost, PARKED, "parked")
    assert depth_sync(fresh_vhost, PARKING) == PARKED
    assert _type(management, fresh_vhost, PARKING) == "classic"

    quorum = _write(tmp_path, _file("quorum"), "quorum.yml")
    plan = run_cli("plan", quorum, settings=fresh_vhost)
    # A parking queue to rebuild does not block: parking into the live one still works.
    assert plan.code == 0, plan.out  # type: ignore[attr-defined]
    line = next(  # type: ignore[attr-defined]
        x for x in plan.out.splitlines() if x.startswith(f"migrate   queue    {PARKING} ")  # type: ignore[attr-defined]
    )
    assert "type: live classic, file quorum" in line
    assert f"migrate keeps its {PARKED} messages" in line  # counted now, not seconds ago
    assert sum(1 for x in plan.out.splitlines() if x.startswith("migrate ")) == 1  # type: ignore[attr-defined]
    note = f"note: {PARKING} is left as it is (type: live classic, file quorum"
    assert plan.err.startswith(note)  # type: ignore[attr-defined]
    applied = run_cli("apply", quorum, settings=fresh_vhost)
    assert applied.code == 0, applied.err  # type: ignore[attr-defined]
    assert applied.err.startswith(note)  # type: ignore[attr-defined]
    assert applied.err.rstrip().endswith(f"`rabbit-retry migrate {quorum}` rebuilds it")  # type: ignore[attr-defined]
    assert applied.out == f"nothing else to do in vhost {fresh_vhost.vhost!r}\n"  # type: ignore[attr-defined]
    assert _type(management, fresh_vhost, PARKING) == "classic"
    assert depth_sync(fresh_vhost, PARKING) == PARKED

    done = run_cli("migrate", quorum, "--yes", settings=fresh_vhost)
    assert done.code == 0, done.err  # type: ignore[attr-defined]
    assert f"migrated 1 queue in vhost {fresh_vhost.vhost!r}: {PARKING}" in done.out  # type: ignore[attr-defined]
    assert _type(management, fresh_vhost, PARKING) == "quorum"
    info = management.queue(fresh_vhost.vhost, PARKING)
    assert info is not None and info["arguments"]["x-delivery-limit"] == 2**31 - 1
    assert management.queue(fresh_vhost.vhost, f"{PARKING}.migrating") is None
    assert run_cli("plan", quorum, settings=fresh_vhost).code == 0  # type: ignore[attr-defined]

    # And back to classic, with a few more parked meanwhile.
    _park(fresh_vhost, 20, "later")
    done = run_cli("migrate", classic, "--yes", settings=fresh_vhost)
    assert done.code == 0, done.err  # type: ignore[attr-defined]
    assert _type(management, fresh_vhost, PARKING) == "classic"
    parked = drain_sync(fresh_vhost, PARKING)
    assert Counter(str(m.message_id) for m in parked) == Counter(
        {f"parked-{i}": 1 for i in range(PARKED)} | {f"later-{i}": 1 for i in range(20)}
    )
    assert all(m.headers.get("parked-reason") == "exhausted" for m in parked)
    # In the order they were parked: a migration reorders nothing.
    assert [str(m.message_id) for m in parked] == (
        [f"parked-{i}" for i in range(PARKED)] + [f"later-{i}" for i in range(20)]
    )
