"""The relay without a broker: while the broker cannot be reached it waits longer and longer
between tries (never a busy loop) and says so once; a SQLite outbox has one publishing relay."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from rabbit_retry.outbox import relay as relay_module
from rabbit_retry.outbox.relay import Relay
from rabbit_retry.outbox.store import OutboxStore
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
queues:
  shop.orders: {}
"""



def _migrated(tmp_path: Path) -> str:
    """A SQLite outbox with its tables, and the topology file ``shop.yml`` beside it."""
    (tmp_path / "shop.yml").write_text(TOPOLOGY)
    url = f"sqlite:///{tmp_path / 'app.db'}"
    store = OutboxStore(url)
    store.migrate()
    store.close()
    return url

async def test_an_unreachable_broker_is_tried_again_with_growing_waits_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "shop.yml").write_text(TOPOLOGY)
    tries: list[int] = []

    async def refused(*_args: object, **_kwargs: object) -> None:
        tries.append(1)
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(relay_module, "connect_amqp", refused)
    relay = Relay(f"sqlite:///{tmp_path / 'app.db'}", tmp_path / "shop.yml",
                  Settings.from_env("amqp://guest:guest@127.0.0.1:1/"))
    waits: list[float] = []

    async def wait(seconds: float) -> None:  # instead of sleeping: note how long
        waits.append(seconds)
        if len(waits) == 10:
            relay.stop()
        await asyncio.sleep(0)

    monkeypatch.setattr(relay, "_wait", wait)
    with caplog.at_level(logging.INFO, logger="rabbit_retry.outbox"):
        await asyncio.wait_for(relay.run(), timeout=60)
    assert len(tries) == 10  # one connect per wait: nothing in between
    # Capped exponential backoff, jittered in the upper half: 0.5, 1, 2, 4, ... 30.
    for n, seconds in enumerate(waits):
        ceiling = min(30.0, 0.5 * 2**n)
        assert ceiling / 2 <= seconds <= ceiling, (n, seconds)
    said = [r.getMessage() for r in caplog.records if "broker unreachable" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("relay: broker unreachable (connection refused")


async def test_on_sqlite_a_second_relay_waits_for_the_first_ones_lease(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    store = OutboxStore(url)
    store.migrate()
    assert store.take_lease("first", 60)
    assert not store.take_lease("second", 60)  # held: the second waits
    assert store.take_lease("first", 60)  # renewed by its holder
    store.drop_lease("first")  # a relay that stops lets go at once
    assert store.take_lease("second", 60)
    assert store.take_lease("third", -1) is False  # still the second's
    store.close()


async def test_a_lost_connection_is_said_with_the_brokers_reason() -> None:
    """A publish on a connection the broker closes can fail with a bare "closed" before the
    broker's ``connection.close`` (and its reason) is read: the relay waits a moment for it, so
    its one line says why (seen on 3.10 under load: the reason was missing)."""
    import aiormq.exceptions

    class Closing:
        def __init__(self) -> None:
            self.closing: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    reason = aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED - outbox test")
    bare = aiormq.exceptions.ChannelInvalidStateError("<Connection> closed")
    late = Closing()
    asyncio.get_running_loop().call_later(0.05, late.closing.set_exception, reason)
    said = relay_module._first_line(await relay_module._lost_with(late, bare))  # type: ignore[arg-type]
    assert "outbox test" in said, said
    clean = Closing()
    clean.closing.set_result(None)  # closed without a reason: the error itself is said
    assert await relay_module._lost_with(clean, bare) is bare  # type: ignore[arg-type]


async def test_the_confirm_watch_counts_from_when_publishing_began_after_an_idle_spell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch closes the connection when no confirm came for its deadline while publishes
    wait. After an idle spell longer than the deadline, a publish that has waited a moment is
    not that (before, the watch counted from the last confirm, minutes ago, and closed a
    connection about to confirm: a reconnect and the batch published again). One that waits
    the whole deadline still is (the positive control)."""
    from rabbit_retry.outbox.relay import Sender

    monkeypatch.setattr(relay_module, "CONFIRM_TIMEOUT_S", 2.0)  # the watch looks every 0.33 s
    closed: list[BaseException | None] = []

    class Connection:
        async def close(self, exc: BaseException | None = None) -> None:
            closed.append(exc)

    sender = Sender(Connection(), "/", "hold")  # type: ignore[arg-type]
    watch = asyncio.create_task(sender.watch(lambda why: None))
    sender.last_confirm -= 600  # the last confirm came ten minutes ago; nothing waited since
    sender.expect("m-1", asyncio.get_running_loop().create_future())
    await asyncio.sleep(0.5)
    assert closed == [] and not watch.done()
    await asyncio.wait_for(watch, 10)  # m-1 never confirmed: the watch ends it
    assert [str(exc) for exc in closed] == ["no publisher confirm within 2s"]


async def test_a_stop_while_the_broker_no_longer_confirms_ends_within_the_confirm_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay asked to stop waits for the claims in flight; the confirm watch stays until they
    end, so a broker that stopped confirming (a resource alarm: its heartbeats go on) ends them
    at the deadline. Before, the watch was cancelled first, and the stop waited for good."""
    import sqlalchemy as sa

    from rabbit_retry.outbox import Outbox
    from rabbit_retry.outbox.relay import Sender, Sent

    url = _migrated(tmp_path)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        Outbox(tmp_path / "shop.yml").add(conn, queue="shop.orders", body=b"1", message_id="m-1")
    engine.dispose()
    monkeypatch.setattr(relay_module, "CONFIRM_TIMEOUT_S", 0.3)

    class Connection:
        is_closed = False

        def __init__(self) -> None:
            self.closing = asyncio.get_running_loop().create_future()

        async def channel(self, **_: Any) -> object:
            return object()

        async def close(self, exc: BaseException | None = None) -> None:
            self.is_closed = True
            if not self.closing.done():
                self.closing.set_result(None)

    class Silent(Sender):
        async def send(self, rows: Any, messages: Any) -> Any:  # out, never confirmed
            for row in rows:
                self.expect(row.message_id, asyncio.get_running_loop().create_future())
            await self.connection.closing  # type: ignore[attr-defined]
            return Sent(suspects=list(rows), broken=ConnectionError("closed"))

    monkeypatch.setattr(relay_module, "Sender", Silent)
    relay = Relay(url, tmp_path / "shop.yml", Settings.from_env("amqp://guest:guest@127.0.0.1:1/"))
    relay._leased.set()
    connection = Connection()
    publishing = asyncio.create_task(relay._publish(connection))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    relay.stop()
    done, _ = await asyncio.wait({publishing}, timeout=5)
    relay.store.close()
    assert done, "the stop still waits for a confirm that never comes"
    assert connection.is_closed  # the watch closed the silent connection


async def test_with_hold_an_event_that_cannot_be_read_holds_its_keys_later_events(
    tmp_path: Path,
) -> None:
    """An event the relay cannot read (a damaged row) fails, and with ``--on-failure hold`` it
    holds its key: the key's next event of the same claim is not published before it (it stays
    pending). Before, only the unreadable one was held back."""
    from datetime import UTC, datetime

    import sqlalchemy as sa

    from rabbit_retry.outbox import Outbox
    from rabbit_retry.outbox.relay import Sent

    url = _migrated(tmp_path)
    engine = sa.create_engine(url)
    outbox = Outbox(tmp_path / "shop.yml")
    with engine.begin() as conn:
        for n in (1, 2):
            outbox.add(conn, queue="shop.orders", body=b"x", message_id=f"k-{n}", key="K")
        outbox.add(conn, queue="shop.orders", body=b"x", message_id="other", key="L")
        conn.execute(sa.text("update rabbit_retry_outbox set properties = '{\"bogus\": 1}' "
                             "where message_id = 'k-1'"))
    sent: list[str] = []

    class Sender:
        hold = True
        connection = type("Open", (), {"is_closed": False})()

        async def send(self, rows: Any, messages: Any) -> Any:
            sent.extend(r.message_id for r in rows)
            return Sent(published=[(r, datetime.now(UTC)) for r in rows])

    relay = Relay(url, tmp_path / "shop.yml", Settings.from_env("amqp://guest:guest@127.0.0.1:1/"))
    await relay._carry(Sender(), await relay._claim())  # type: ignore[arg-type]
    relay.store.close()
    with engine.connect() as conn:
        statuses = dict(conn.execute(sa.text(
            "select message_id, status from rabbit_retry_outbox")).all())
    engine.dispose()
    assert sent == ["other"]  # positive control: another key's event goes out
    assert statuses == {"k-1": "failed", "k-2": "pending", "other": "published"}


async def test_a_relay_whose_lease_renewal_hangs_stops_publishing_before_the_lease_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SQLite: a renewal that hangs (the database locked by the application) no longer leaves
    the relay publishing past its lease, while another relay may take it over: it stops at
    four fifths of the lease, counted from when it asked, and publishes again once renewed."""
    import threading

    url = _migrated(tmp_path)
    monkeypatch.setattr(relay_module, "LEASE_S", 0.6)  # renewed every 0.2 s
    relay = Relay(url, tmp_path / "shop.yml", Settings.from_env("amqp://guest:guest@127.0.0.1:1/"))
    unlocked, calls = threading.Event(), []
    loop, hanging = asyncio.get_running_loop(), asyncio.Event()

    def take_lease(owner: str, seconds: float) -> bool:
        calls.append(owner)
        if len(calls) == 2:
            loop.call_soon_threadsafe(hanging.set)
            unlocked.wait(10)  # the second renewal hangs until the test lets it go
        return True

    monkeypatch.setattr(relay.store, "take_lease", take_lease)
    leasing = asyncio.create_task(relay._lease())
    try:
        await asyncio.wait_for(relay._leased.wait(), 5)  # positive control: it holds the lease
        await asyncio.wait_for(hanging.wait(), 5)
        for _ in range(200):  # the lease was asked for at about 0.2 s; 0.48 s later it stops
            if not relay._leased.is_set():
                break
            await asyncio.sleep(0.01)
        assert not relay._leased.is_set(), "still publishing on a lease that may have run out"
        unlocked.set()
        await asyncio.wait_for(relay._leased.wait(), 5)  # renewed: publishing again
    finally:
        unlocked.set()
        leasing.cancel()
        relay.store.close()
