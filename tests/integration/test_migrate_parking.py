"""``rabbit-retry migrate`` of a parking queue holding messages on a real broker: a file that
asks for quorum parking (docs/cluster.md) where the live parking queue is classic, and back."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from support.amqp import blocking, depth, depth_sync, drain_sync, persistent, publish_stream
from support.poll import eventually
from support.provision import topology
from support.worker import running

from rabbit_retry import Delivery, Permanent, RetryConsumer
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


CHUNK = 200  # messages written at a time (800 a second) while the parking queue is rebuilt


class DeclineAll(RetryConsumer):
    """Parks every message at once (``Permanent``), as fast as the worker can."""

    queue = Q
    prefetch = 100
    parked = 0

    async def handle(self, delivery: Delivery) -> None:
        DeclineAll.parked += 1
        raise Permanent("declined")


def test_a_parking_queue_rebuilt_while_a_worker_parks_into_it_loses_no_park(
    tmp_path: Path, fresh_vhost: Settings, management: Management, run_cli: Callable[..., object]
) -> None:
    """The worker parks through the default exchange, which migrate cannot redirect, and
    RabbitMQ confirms a publish on its way to a queue deleted under it: a park in flight as the
    old parking queue is deleted would be acked and lost. Counted: every message published is
    in the new parking queue."""
    classic = _file("classic")
    assert run_cli("apply", _write(tmp_path, classic, "classic.yml"),  # type: ignore[attr-defined]
                   settings=fresh_vhost).code == 0
    quorum = _file("quorum")
    new = _write(tmp_path, quorum, "quorum.yml")
    DeclineAll.parked = 0
    written = 0
    migrated = asyncio.Event()

    async def write() -> None:
        """Chunks until a chunk was written after the migration: the worker parks throughout."""
        nonlocal written
        while True:
            after = migrated.is_set()
            await publish_stream(
                fresh_vhost, "order.created", CHUNK,
                lambda i, first=written: persistent(b"{}", message_id=f"m-{first + i}"),
                exchange="shop",
                rate=800)
            written += CHUNK
            if after:
                return

    async def go() -> None:
        async with running([DeclineAll()], topology(quorum, new), fresh_vhost):
            writer = asyncio.create_task(write())
            await eventually(lambda: DeclineAll.parked >= 300, what="parks flowing")
            done = await asyncio.to_thread(run_cli, "migrate", new, "--yes",
                                           settings=fresh_vhost)
            migrated.set()
            assert done.code == 0, done.err  # type: ignore[attr-defined]
            # The worker's connection was closed for the deletion.
            assert f"{PARKING}: closed consumer connection " in done.out  # type: ignore[attr-defined]
            await writer

            async def all_parked() -> bool:
                return (await depth(fresh_vhost, PARKING) or 0) >= written

            # A lost park leaves the count short for good: counted below, by id.
            with contextlib.suppress(AssertionError):
                await eventually(all_parked, within=60, interval=0.5, what="every message parked")

    asyncio.run(go())
    assert _type(management, fresh_vhost, PARKING) == "quorum"
    parked = Counter(str(m.message_id) for m in drain_sync(fresh_vhost, PARKING))
    lost = sorted({f"m-{i}" for i in range(written)} - set(parked))
    assert lost == [], f"lost {len(lost)} of {written}: {lost[:10]}"
    assert set(parked) == {f"m-{i}" for i in range(written)}
    assert depth_sync(fresh_vhost, Q) == 0
