"""A desk replay through faults, without a broker (the broker confirms each copy a moment after
it is published): a cancel of a replay taken over from a desk that died, a store that fails once
while confirmed rows are written, and lease renewals that fail."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands as spec

from rabbit_retry.desk import actions
from rabbit_retry.desk import replay as replay_module
from rabbit_retry.desk.ledger import Claimed, Ledger
from rabbit_retry.desk.records import parked
from rabbit_retry.desk.store import Selection, Store
from rabbit_retry.settings import Settings

NOW = datetime(2026, 11, 30, tzinfo=UTC)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """300 parked messages; publishing confirms each copy 10 ms later."""

    async def confirming(channel: Any, target: str, messages: list[Any]) -> list[Any]:
        loop = asyncio.get_running_loop()
        futures = []
        for _ in messages:
            future = loop.create_future()
            loop.call_later(0.01, future.set_result, None)
            futures.append(future)
        return futures

    monkeypatch.setattr(replay_module, "publish_batch", confirming)
    store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
    store.migrate()
    store.insert([parked("orders", f"body {i}".encode(), spec.Basic.Properties(
        message_id=f"m-{i}", headers={"parked-id": uuid.uuid4().hex}), now=NOW)
        for i in range(300)], NOW)
    return store


def _statuses(ledger: Ledger) -> dict[str, int]:
    import sqlalchemy as sa

    from rabbit_retry.desk.schema import messages

    with ledger.store.tx() as tx:
        return {str(s): int(n) for s, n in tx.execute(
            sa.select(messages.c.status, sa.func.count()).group_by(messages.c.status))}


async def test_a_cancelled_replay_taken_over_from_a_desk_that_died_ends(store: Store) -> None:
    """The desk that died had claimed 128 rows (their copies may be out); an operator cancels;
    the desk that takes the replay over sends those 128 again, settles them, leaves the rest
    parked and ends it cancelled. Before, it stopped at the cancel without them, and every
    takeover failed on 'rows still unconfirmed': the rows stayed 'replaying' for good."""
    ledger = Ledger(store)
    replay_id, taken = ledger.start_replay(Selection(ids=tuple(range(1, 301))), "ana",
                                           "desk-a", to_queue=None, rate=None, lease=-1)
    assert taken == 300 and len(ledger.claim(replay_id, 0, 128).rows) == 128
    ledger.cancel(replay_id, "ana")
    claimed = ledger.take_abandoned("desk-b", 30)
    assert claimed is not None and claimed.resent == 128
    replay = replay_module.Replay(ledger, object(), claimed, "guest")  # type: ignore[arg-type]
    result = await asyncio.wait_for(replay.run(), 10)
    assert result.state is replay_module.State.CANCELLED
    assert result.replayed == 128
    assert _statuses(ledger) == {"replayed": 128, "parked": 172}


@pytest.mark.parametrize("fails", [False, True], ids=["control", "store-fails-once"])
async def test_a_store_that_fails_once_while_confirmed_rows_are_written_delays_the_replay(
    store: Store, fails: bool
) -> None:
    """Before, the answers taken for that write were dropped with the helper that wrote them:
    the replay waited for them for good (its lease kept alive), 300 left 'replaying'."""

    class Flaky(Ledger):
        failed = False

        def step(self, replay_id: str, confirmed: Any, refused: Any, after: int,
                 limit: int) -> Any:
            if fails and limit == 0 and confirmed and not self.failed:
                self.failed = True
                raise RuntimeError("database is locked")
            return super().step(replay_id, confirmed, refused, after, limit)

    ledger = Flaky(store)
    replay_id, _ = ledger.start_replay(Selection(ids=tuple(range(1, 301))), "ana", "desk-a",
                                       to_queue=None, rate=None, lease=30)
    replay = replay_module.Replay(ledger, object(),  # type: ignore[arg-type]
                                  Claimed(replay_id, None, None), "guest")
    result = await asyncio.wait_for(replay.run(), 20)
    assert ledger.failed is fails
    assert result.state is replay_module.State.DONE and result.replayed == 300
    assert _statuses(ledger) == {"replayed": 300}


@pytest.mark.parametrize(("failures", "stopped"), [(1, False), (99, True)],
                         ids=["one-failure", "failing-past-two-thirds"])
async def test_a_failed_lease_renewal_is_tried_again_until_the_lease_may_have_run_out(
    store: Store, monkeypatch: pytest.MonkeyPatch, failures: int, stopped: bool
) -> None:
    """One renewal that fails (the store) is tried again at the next, and the replay goes on.
    Renewals failing for two thirds of the lease stop the replay here, before the lease runs
    out and another desk (or this one) takes it over: before, the first failure ended the
    renewals silently while the replay went on, and a second run of it started beside."""
    renew, calls = Ledger.renew, []

    def flaky(self: Ledger, replay_id: str, owner: str, lease: float) -> bool:
        calls.append(replay_id)
        if len(calls) <= failures:
            raise RuntimeError("server closed the connection unexpectedly")
        return renew(self, replay_id, owner, lease)

    monkeypatch.setattr(Ledger, "renew", flaky)
    desk = actions.Actions(store, Settings.from_env(), {"orders"}, owner="desk-a", lease=1.5)
    closed: list[bool] = []

    class Channel:
        async def close(self) -> None:
            closed.append(True)

    replay_id, _ = desk.ledger.start_replay(Selection(ids=(1,)), "ana", "desk-a",
                                            to_queue=None, rate=None, lease=30)

    class Running:
        claimed = Claimed(replay_id, None, None)
        channel = Channel()

    keeping = asyncio.create_task(desk._keep_lease(Running()))  # type: ignore[arg-type]
    await asyncio.wait({keeping}, timeout=2.2)  # renewals at 0.5, 1.0 and 1.5 s
    assert keeping.done() is stopped and bool(closed) is stopped
    assert len(calls) == (2 if stopped else 4)
    keeping.cancel()


def test_a_restored_holder_holds_its_key_again_or_no_longer_names_a_hold_that_ended(
    tmp_path: Path,
) -> None:
    """Two discarded holders of ordered keys are restored: the one whose release had not gone
    out holds its key again (its release is not sent); the one whose release went out let its
    key go on, so its copy no longer names the hold. Before, the release was sent after the
    restore anyway, and a holder replayed after its release named a hold that had ended: the
    worker took it for a stale copy and dropped it."""
    from rabbit_retry import contract
    from rabbit_retry.desk.records import stored_headers

    store = Store(f"sqlite:///{tmp_path / 'desk.db'}")
    store.migrate()
    store.insert([parked("rewards.points", b"{}", spec.Basic.Properties(
        message_id=f"{user}-1", headers={
            "parked-id": uuid.uuid4().hex, contract.ORDERED_KEY: user,
            contract.ORDERED_HOLD: uuid.uuid4().hex, contract.ORDERED_LANE: "1/4"}), now=NOW)
        for user in ("alice", "bob")], NOW)
    ledger = Ledger(store)
    assert ledger.discard(Selection(ids=(1, 2)), "ana", "wrong account") == 2
    assert [r["id"] for r in ledger.pending_releases()] == [1, 2]
    ledger.released([1])  # alice's release went out; bob's waits
    assert ledger.restore(Selection(ids=(1, 2)), "ana", "not wrong after all") == 2
    assert ledger.pending_releases() == []
    with store.tx() as tx:
        import sqlalchemy as sa

        from rabbit_retry.desk.schema import messages

        rows = {r.id: dict(r._mapping) for r in tx.execute(sa.select(messages))}
    alice, bob = stored_headers(rows[1]), stored_headers(rows[2])
    assert contract.ORDERED_HOLD not in alice and contract.ORDERED_LANE not in alice
    assert alice[contract.ORDERED_KEY] == "alice"
    assert contract.ORDERED_HOLD not in rows[1]["headers"]
    assert contract.ORDERED_HOLD in bob and bob[contract.ORDERED_LANE] == "1/4"
