"""``renamed_from`` on a real broker: a queue renamed in the file, whose old queue holds
messages in itself, a retry tier and its parking queue; ``migrate`` moves every one of them to
the new queue's objects exactly once and deletes the old ones."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.amqp import blocking, depth_sync, drain_sync, persistent, publish_stream
from support.poll import wait_for

from rabbit_retry.broker.management import Management
from rabbit_retry.errors import EXIT_PENDING
from rabbit_retry.settings import Settings
from rabbit_retry.topology import naming

OLD, NEW = "ren.old", "ren.new"
MAIN, RETRYING, PARKED = 300, 20, 10
STOPPED = 5  # copies a stopped run left in the new queue
TIER_OF = {q: naming.tier_queue(q, 3_600_000) for q in (OLD, NEW)}

FILE = """\
version: 1
exchanges:
  shop: {{type: topic}}
queues:
  {name}:
    queue_type: {kind}
{extra}    bindings: [{{exchange: shop, routing_key: "order.*"}}]
    retry: {{delays: [1h], max_attempts: 3}}
"""


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _fill(settings: Settings) -> None:
    def make(prefix: str, **headers: object) -> Callable[[int], object]:
        return lambda i: persistent(b'{"n": %d}' % i, message_id=f"{prefix}-{i}",
                                    headers=dict(headers) or None)

    blocking(publish_stream(settings, "order.created", MAIN, make("main"),  # type: ignore[arg-type]
                            exchange="shop"))
    blocking(publish_stream(settings, TIER_OF[OLD], RETRYING,  # as the worker sends a retry
                            make("tier", **{"retry-count": 1})))  # type: ignore[arg-type]
    blocking(publish_stream(settings, naming.parking_queue(OLD), PARKED,
                            make("park", **{"parked-reason": "exhausted"})))  # type: ignore[arg-type]


def _ids(settings: Settings, queue: str) -> Counter[str]:
    return Counter(str(m.message_id) for m in drain_sync(settings, queue))


@pytest.mark.parametrize("kind", ["quorum", "classic"])
def test_a_renamed_queue_moves_every_message_once_and_the_old_objects_go(
    kind: str, tmp_path: Path, fresh_vhost: Settings, management: Management,
    run_cli: Callable[..., Any],  # the run_cli fixture of tests/conftest.py
) -> None:
    old = _write(tmp_path, "old.yml", FILE.format(name=OLD, kind=kind, extra=""))
    new = _write(tmp_path, "new.yml",
                 FILE.format(name=NEW, kind=kind, extra=f"    renamed_from: {OLD}\n"))
    assert run_cli("apply", old, settings=fresh_vhost).code == 0
    _fill(fresh_vhost)
    assert depth_sync(fresh_vhost, OLD) == MAIN
    assert depth_sync(fresh_vhost, TIER_OF[OLD]) == RETRYING
    assert depth_sync(fresh_vhost, naming.parking_queue(OLD)) == PARKED

    plan = run_cli("plan", new, "--detailed-exitcode", settings=fresh_vhost)
    assert plan.code == EXIT_PENDING, plan.out + plan.err
    line = next(x for x in plan.out.splitlines() if x.startswith("migrate "))
    assert f"queue    {OLD} -> {NEW}  (migrate moves its {MAIN} messages " in line
    assert f"({OLD}.parking: {PARKED} parked, tiers: {RETRYING} retrying)" in line

    applied = run_cli("apply", new, settings=fresh_vhost)
    assert applied.code == 0, applied.err
    assert f"note: queue {OLD} -> {NEW}: renamed in the file" in applied.err
    assert depth_sync(fresh_vhost, NEW) == 0  # created, bound: the messages are migrate's
    # Still pending after apply: --detailed-exitcode does not say "in sync".
    assert run_cli("plan", new, "--detailed-exitcode", settings=fresh_vhost).code == EXIT_PENDING

    status = run_cli("status", new, settings=fresh_vhost)
    assert f"{OLD} -> {NEW}" in status.out, status.out + status.err
    # As a run stopped after these copies were confirmed, before their originals were acked.
    blocking(publish_stream(fresh_vhost, NEW, STOPPED,
                            lambda i: persistent(b'{"n": %d}' % i, message_id=f"main-{i}")))
    migrated = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert migrated.code == 0, migrated.out + migrated.err
    assert f"{OLD}: moved {MAIN - STOPPED} messages into {NEW} ({STOPPED} already there)" \
        in migrated.out
    assert f"renamed 1 queue in vhost {fresh_vhost.vhost!r}: {OLD} -> {NEW} " \
           f"({MAIN + RETRYING + PARKED - STOPPED} messages moved)" in migrated.out

    after = run_cli("plan", new, "--detailed-exitcode", settings=fresh_vhost)
    assert after.code == 0, after.out + after.err
    assert OLD not in after.out
    status = run_cli("status", new, settings=fresh_vhost)
    assert status.code == 0 and OLD not in status.out, status.out + status.err
    for gone in (OLD, TIER_OF[OLD], naming.parking_queue(OLD), naming.migrating_queue(OLD)):
        assert management.queue(fresh_vhost.vhost, gone) is None, gone
    exchanges = {e["name"] for e in management.exchanges(fresh_vhost.vhost)}
    assert naming.retry_exchange(OLD) not in exchanges and "shop" in exchanges

    # A message published afterwards reaches the new queue, once.
    blocking(publish_stream(fresh_vhost, "order.created", 1,
                            lambda i: persistent(b"{}", message_id="after-0"), exchange="shop"))
    assert depth_sync(fresh_vhost, TIER_OF[NEW]) == 0
    moved = [m for m in drain_sync(fresh_vhost, NEW)]
    ids = Counter(str(m.message_id) for m in moved)
    assert ids == Counter([*(f"main-{i}" for i in range(MAIN)),
                           *(f"tier-{i}" for i in range(RETRYING)), "after-0"])
    retried = next(m for m in moved if m.message_id == "tier-0")
    assert retried.headers["retry-count"] == 1  # headers kept
    parked = drain_sync(fresh_vhost, naming.parking_queue(NEW))
    assert Counter(str(m.message_id) for m in parked) == Counter(
        f"park-{i}" for i in range(PARKED))
    assert all(m.headers["parked-reason"] in ("exhausted", b"exhausted") for m in parked)


@pytest.mark.parametrize("kind", ["quorum", "classic"])
def test_what_the_old_queue_dead_letters_after_its_tier_is_deleted_reaches_the_new_one(
    kind: str, tmp_path: Path, fresh_vhost: Settings, monkeypatch: pytest.MonkeyPatch,
    run_cli: Callable[..., Any],
) -> None:
    """The old queue's dead letters go through its retry exchange to its first tier, which the
    rename deletes before the old queue (whose tiers expire into it). A message the old queue
    dead-letters once its tier is gone (one that expires there, or overflows, or is rejected:
    rejected here, right after the tier's deletion, so that it happens in that window every
    time) used to have no route, and the broker dropped it. Now it reaches the new queue."""
    from rabbit_retry.broker import migrate

    old = _write(tmp_path, "old.yml", FILE.format(name=OLD, kind=kind, extra=""))
    new = _write(tmp_path, "new.yml",
                 FILE.format(name=NEW, kind=kind, extra=f"    renamed_from: {OLD}\n"))
    assert run_cli("apply", old, settings=fresh_vhost).code == 0
    _fill(fresh_vhost)
    assert run_cli("apply", new, settings=fresh_vhost).code == 0
    rejected: list[str] = []
    delete_emptied = migrate._delete_emptied

    async def then_reject(run: migrate.MigrationRun, queue: str) -> None:
        await delete_emptied(run, queue)
        if queue != TIER_OF[OLD]:
            return
        channel = await run.channel()
        got = await channel.basic_get(OLD, no_ack=False)
        assert got.delivery_tag is not None and got.header.properties.message_id
        rejected.append(got.header.properties.message_id)
        await channel.basic_reject(got.delivery_tag, requeue=False)
        await channel.close()

    monkeypatch.setattr(migrate, "_delete_emptied", then_reject)
    migrated = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert migrated.code == 0, migrated.out + migrated.err
    assert rejected == ["main-0"]
    assert depth_sync(fresh_vhost, TIER_OF[NEW]) == 0
    assert _ids(fresh_vhost, NEW) == Counter([*(f"main-{i}" for i in range(MAIN)),
                                              *(f"tier-{i}" for i in range(RETRYING))])
    assert _ids(fresh_vhost, naming.parking_queue(NEW)) == Counter(
        f"park-{i}" for i in range(PARKED))


def test_a_new_parking_queue_deleted_after_migrate_read_the_broker_is_one_line_and_no_change(
    tmp_path: Path, fresh_vhost: Settings, management: Management,
    monkeypatch: pytest.MonkeyPatch, run_cli: Callable[..., Any],
) -> None:
    """The old queue's retry exchange routes to its parking queue (on_full: park), so the
    rename's redirect binds it to the new parking queue. Deleted by hand once migrate has read
    the broker (and found it there), that bind failed with the broker's text after the old
    queue was unbound (3.10.8: ``error: renaming ren.old to ren.new stopped: NOT_FOUND - no
    queue 'ren.new.parking' in vhost '...'; nothing is lost, run migrate again to finish``,
    exit 1). Now one line naming it, exit 3, and not a binding changed; apply, then migrate,
    finish the rename."""
    from contextlib import asynccontextmanager
    from urllib.parse import quote

    from rabbit_retry.broker import migrate
    from rabbit_retry.errors import EXIT_CONFLICT

    extra = "    policy: {max_length: 1000}\n    on_full: park\n"
    old = _write(tmp_path, "old.yml", FILE.format(name=OLD, kind="classic", extra=extra))
    new = _write(tmp_path, "new.yml", FILE.format(
        name=NEW, kind="classic", extra=f"    renamed_from: {OLD}\n{extra}"))
    assert run_cli("apply", old, settings=fresh_vhost).code == 0
    _fill(fresh_vhost)
    assert run_cli("apply", new, settings=fresh_vhost).code == 0
    parking = naming.parking_queue(NEW)
    retry = naming.retry_exchange(OLD)
    assert any(b["source"] == retry and b["destination"] == naming.parking_queue(OLD)
               for b in management.bindings(fresh_vhost.vhost))
    opened = migrate.migration_run

    @asynccontextmanager
    async def deleted_first(settings: Settings, say: migrate.Say) -> Any:
        path = f"/queues/{quote(fresh_vhost.vhost, safe='')}/{quote(parking, safe='')}"
        assert management.request("DELETE", path).status_code < 300
        async with opened(settings, say) as run:
            yield run

    def bindings() -> set[tuple[str, str, str]]:
        return {(b["source"], b["destination"], b["routing_key"])
                for b in management.bindings(fresh_vhost.vhost)}

    monkeypatch.setattr(migrate, "migration_run", deleted_first)
    migrated = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert migrated.code == EXIT_CONFLICT, migrated.out + migrated.err
    assert migrated.err.splitlines()[-1] == (
        f"error: queue {OLD} -> {NEW}: {parking} is not on the broker (deleted after migrate "
        "read it?); run apply with the file first, which declares it, then migrate again; "
        "nothing was changed")
    assert "Traceback" not in migrated.err and "NOT_FOUND" not in migrated.err
    after = bindings()
    assert (retry, naming.parking_queue(OLD), OLD) in after
    assert ("shop", OLD, "order.*") in after  # the old queue is still bound: nothing changed
    assert depth_sync(fresh_vhost, OLD) == MAIN
    assert depth_sync(fresh_vhost, naming.parking_queue(OLD)) == PARKED

    monkeypatch.setattr(migrate, "migration_run", opened)
    assert run_cli("apply", new, settings=fresh_vhost).code == 0
    finished = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert finished.code == 0, finished.out + finished.err
    assert depth_sync(fresh_vhost, NEW) == MAIN + RETRYING
    assert depth_sync(fresh_vhost, parking) == PARKED


LIMITED = 200  # the new queue's max_length
IN_NEW = 50  # messages the new queue holds before the rename moves the old one's in
LATE = 100  # published through the exchange (to both queues) once migrate has counted


def _limited(tmp_path: Path, kind: str, on_full: str, limit: int = LIMITED) -> tuple[str, str]:
    old = _write(tmp_path, "old.yml", FILE.format(name=OLD, kind=kind, extra=""))
    new = _write(tmp_path, "new.yml", FILE.format(
        name=NEW, kind=kind, extra=f"    renamed_from: {OLD}\n    policy: {{max_length: {limit}}}"
                                   f"\n    on_full: {on_full}\n"))
    return old, new


def _filled(settings: Settings, run_cli: Callable[..., Any], old: str, new: str) -> None:
    assert run_cli("apply", old, settings=settings).code == 0
    blocking(publish_stream(settings, "order.created", MAIN,
                            lambda i: persistent(b"{}", message_id=f"main-{i}"), exchange="shop"))
    assert run_cli("apply", new, settings=settings).code == 0
    blocking(publish_stream(settings, NEW, IN_NEW,
                            lambda i: persistent(b"{}", message_id=f"new-{i}")))
    assert (depth_sync(settings, OLD), depth_sync(settings, NEW)) == (MAIN, IN_NEW)


def _listed(management: Management, settings: Settings) -> None:
    """Until the management statistics (which plan reads) count what was published."""
    wait_for(lambda: [(management.queue(settings.vhost, q) or {}).get("messages_ready")
                      for q in (OLD, NEW)] == [MAIN, IN_NEW], "the statistics caught up")


@pytest.mark.parametrize("on_full", ["park", "drop"])
def test_a_rename_into_a_queue_it_overfills_names_the_evicted_and_moves_only_when_accepted(
    on_full: str, tmp_path: Path, fresh_vhost: Settings, management: Management,
    monkeypatch: pytest.MonkeyPatch, run_cli: Callable[..., Any],
) -> None:
    """The new queue's length limit evicts what does not fit once the old queue's messages are
    moved in: parked or dropped as the file says. migrate said "300 messages moved" and exit 0
    without --accept-evictions (3.10.8: 200 kept, 100 parked, no word of it). Now plan names
    them, migrate refuses without --accept-evictions (exit 3, nothing changed), and with it
    counts again after the old queue is unbound, just before the move: the LATE messages
    published to both queues once migrate has counted them are evicted too, and counted.
    Counted: kept + parked = every message published, once (park); kept + the evicted said =
    published (drop)."""
    from rabbit_retry.broker import migrate
    from rabbit_retry.errors import EXIT_CONFLICT

    old, new = _limited(tmp_path, "classic", on_full)
    _filled(fresh_vhost, run_cli, old, new)
    _listed(management, fresh_vhost)
    parking = naming.parking_queue(NEW)
    fate = f"parked in {parking}" if on_full == "park" else "dropped (the file says drop)"
    first = MAIN + IN_NEW - LIMITED
    detail = (f"max_length {LIMITED} with the messages of {OLD} moved in: {first} of its "
              f"{MAIN + IN_NEW} messages leave it at once, {fate}")
    planned = run_cli("plan", new, settings=fresh_vhost)
    assert f"evicts    queue    {NEW}  ({detail})" in planned.out, planned.out + planned.err

    refused = run_cli("migrate", new, "--yes", settings=fresh_vhost)
    assert refused.code == EXIT_CONFLICT, refused.out + refused.err
    assert refused.err.strip().splitlines() == [
        f"error: queue {NEW}: {detail}",
        "error: nothing was changed; pass --accept-evictions to make this change"]
    assert (depth_sync(fresh_vhost, OLD), depth_sync(fresh_vhost, NEW),
            depth_sync(fresh_vhost, parking)) == (MAIN, IN_NEW, 0)
    assert any(b["source"] == "shop" and b["destination"] == OLD
               for b in management.bindings(fresh_vhost.vhost))  # still bound: nothing changed

    targets_there = migrate._targets_there

    async def arriving(run: migrate.MigrationRun, rename: Any) -> None:
        await publish_stream(fresh_vhost, "order.created", LATE,
                             lambda i: persistent(b"{}", message_id=f"late-{i}"),
                             exchange="shop")
        await targets_there(run, rename)

    monkeypatch.setattr(migrate, "_targets_there", arriving)
    done = run_cli("migrate", new, "--yes", "--accept-evictions", settings=fresh_vhost)
    assert done.code == 0, done.out + done.err
    # The LATE reached both queues: their copies in the old one are recognised in the new one
    # (same message_id and body) and not moved again, so they evict nothing more.
    assert f"{OLD}: moved {MAIN} messages into {NEW} ({LATE} already there)" in done.out, done.out
    published = MAIN + IN_NEW + LATE
    evicted = published - LIMITED
    assert (f"evicted from {NEW}: max_length {LIMITED} with the messages of {OLD} moved in: at "
            f"least {evicted} of its {published} messages left it, {fate} (counted just before "
            f"the messages of {OLD} were moved; messages that arrived in between left too)"
            ) in done.out, done.out
    kept = _ids(fresh_vhost, NEW)
    parked = _ids(fresh_vhost, parking)
    assert management.queue(fresh_vhost.vhost, OLD) is None
    assert sum(kept.values()) == LIMITED
    # Every message published is kept, parked, or dropped and said so, once.
    everything = Counter([*(f"main-{i}" for i in range(MAIN)), *(f"new-{i}" for i in range(IN_NEW)),
                          *(f"late-{i}" for i in range(LATE))])
    if on_full == "park":
        assert kept + parked == everything
    else:
        assert sum(parked.values()) == 0 and sum(kept.values()) + evicted == published
        assert not kept - everything


def test_a_rename_into_a_quorum_queue_that_refuses_the_overflow_keeps_it_in_the_old_queue(
    tmp_path: Path, fresh_vhost: Settings, monkeypatch: pytest.MonkeyPatch,
    management: Management, run_cli: Callable[..., Any],
) -> None:
    """A quorum queue over its limit refuses publishes (on_full: reject): the move's copies
    are nacked. migrate used to start anyway (3.10.8, 300 into 50 under 200: exit 1 after
    unbinding the old queue, "the broker refused a copy (publisher nack; is 'ren.new' full?)",
    200 left in the old queue and 236 in the new one). Now it refuses before any change,
    --accept-evictions or not; and a queue filled in the moment before the move (here by 350
    published to it straight, to its limit) stops it with one line, nothing lost."""
    from rabbit_retry.broker import migrate
    from rabbit_retry.errors import EXIT_CONFLICT

    old, new = _limited(tmp_path, "quorum", "reject")
    _filled(fresh_vhost, run_cli, old, new)
    _listed(management, fresh_vhost)
    detail = (f"max_length {LIMITED} with the messages of {OLD} moved in: up to "
              f"{MAIN + IN_NEW - LIMITED} of its {MAIN + IN_NEW} messages do not fit; it refuses "
              f"them (on_full: reject, with --accept-evictions too) and they stay in {OLD}")
    assert f"evicts    queue    {NEW}  ({detail})" in run_cli("plan", new,
                                                            settings=fresh_vhost).out
    refused = run_cli("migrate", new, "--yes", "--accept-evictions", settings=fresh_vhost)
    assert refused.code == EXIT_CONFLICT, refused.out + refused.err
    assert refused.err.strip().splitlines() == [
        f"error: queue {NEW}: {detail}",
        f"error: nothing was changed; let the consumers of {NEW} make room, or raise its limit "
        "in the file and apply it, then run migrate again"]
    assert (depth_sync(fresh_vhost, OLD), depth_sync(fresh_vhost, NEW)) == (MAIN, IN_NEW)

    _, new = _limited(tmp_path, "quorum", "reject", limit=400)  # room for 350
    assert run_cli("apply", new, settings=fresh_vhost).code == 0
    peek = migrate.MigrationRun.peek
    once: list[str] = []

    async def filled_first(run: migrate.MigrationRun, queue: str) -> Any:
        if queue == NEW and not once:
            once.append(queue)
            # to its limit (50 + 350 = 400): a quorum queue enforces reject-publish
            # approximately (3.10.8 once took all 300 copies on top of 100 fills), so the move
            # starts with the queue full, and its first copies are refused
            await publish_stream(fresh_vhost, NEW, 350,
                                 lambda i: persistent(b"{}", message_id=f"fill-{i}"))
        return await peek(run, queue)

    monkeypatch.setattr(migrate.MigrationRun, "peek", filled_first)
    stopped = run_cli("migrate", new, "--yes", "--accept-evictions", settings=fresh_vhost)
    assert stopped.code == 1, stopped.out + stopped.err
    [line] = stopped.err.strip().splitlines()
    assert line.startswith(f"error: renaming {OLD} to {NEW}: {NEW} refused a copy"), line
    left = _ids(fresh_vhost, OLD)
    kept = _ids(fresh_vhost, NEW)
    print("left", sum(left.values()), "kept", sum(kept.values()))
    # Nothing lost: every message is in one queue or the other (some in both: copies the new
    # queue confirmed after it refused one, whose originals were not acked).
    assert set(left) | set(kept) == {*(f"main-{i}" for i in range(MAIN)),
                                     *(f"new-{i}" for i in range(IN_NEW)),
                                     *(f"fill-{i}" for i in range(350))}
    assert f"the copies it did not take stay in {OLD}, nothing is lost" in line, line
