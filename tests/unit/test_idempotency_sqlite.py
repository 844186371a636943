"""The SQLite idempotency store on its own, in a file under tmp_path: every verdict, leases and
windows running out, tokens, the URLs it takes or refuses, the sweep, an event loop that goes on
while another process holds the file, and several processes claiming the same keys at once."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import sqlite3
import threading
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.worker.stores import Claim, Store, Verdict, open_store
from rabbit_retry.worker.stores import sqlite as sqlite_store

S = "q"  # the scope


def url(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = open_store(url(tmp_path / "keys.db"))
    await opened.open()
    yield opened
    await opened.close()


async def wait_for(store: Store, key: str, token: str, verdict: Verdict) -> Claim:
    """Asks until ``verdict`` comes (a lease or window of 0.2 s has run out), 10 s at most."""
    for _ in range(200):
        claim = await store.claim(S, key, token, 30)
        if claim.verdict is verdict:
            return claim
        await asyncio.sleep(0.05)
    return claim


async def test_every_verdict(store: Store) -> None:
    assert await store.claim(S, "k", "a", 30) == Claim(Verdict.CLAIMED)
    assert await store.claim(S, "k", "a", 30) == Claim(Verdict.CLAIMED)  # its holder, again
    busy = await store.claim(S, "k", "b", 20)
    assert busy.verdict is Verdict.BUSY and 25 < busy.expires_in <= 30  # a's lease, not b's
    await store.release(S, "k", "b")  # not b's to release
    assert (await store.claim(S, "k", "b", 30)).verdict is Verdict.BUSY
    await store.release(S, "k", "a")
    assert await store.claim(S, "k", "b", 30) == Claim(Verdict.CLAIMED)
    await store.done(S, "k", "b", 60)
    assert await store.claim(S, "k", "c", 30) == Claim(Verdict.DUPLICATE)
    await store.release(S, "k", "b")  # a done key stays done, even for the token that did it
    assert await store.claim(S, "k", "c", 30) == Claim(Verdict.DUPLICATE)
    # Scopes are apart: the same key in another queue is another key.
    assert await store.claim(S + "2", "k", "c", 30) == Claim(Verdict.CLAIMED)
    assert await store.claim("", "k", "c", 30) == Claim(Verdict.CLAIMED)


async def test_a_done_key_is_a_duplicate_for_the_token_that_did_it_too(store: Store) -> None:
    await store.claim(S, "k", "a", 30)
    await store.done(S, "k", "a", 60)
    assert await store.claim(S, "k", "a", 30) == Claim(Verdict.DUPLICATE)


async def test_done_holds_whoever_holds_the_claim(store: Store) -> None:
    await store.done(S, "never-claimed", "a", 60)
    assert await store.claim(S, "never-claimed", "b", 30) == Claim(Verdict.DUPLICATE)
    await store.claim(S, "k", "holder", 30)
    await store.done(S, "k", "late", 60)  # its lease ran out and another took it: still done
    assert await store.claim(S, "k", "c", 30) == Claim(Verdict.DUPLICATE)


async def test_a_lease_runs_out_and_the_old_holder_can_no_longer_release(store: Store) -> None:
    assert (await store.claim(S, "k", "dead", 0.2)).verdict is Verdict.CLAIMED
    busy = await store.claim(S, "k", "live", 30)
    assert busy.verdict is Verdict.BUSY and 0 < busy.expires_in <= 0.2
    assert (await wait_for(store, "k", "live", Verdict.CLAIMED)).verdict is Verdict.CLAIMED
    await store.release(S, "k", "dead")  # no longer its claim
    assert (await store.claim(S, "k", "other", 30)).verdict is Verdict.BUSY


async def test_claiming_again_renews_the_lease(store: Store) -> None:
    await store.claim(S, "k", "a", 0.2)
    assert await store.claim(S, "k", "a", 30) == Claim(Verdict.CLAIMED)
    await asyncio.sleep(0.4)  # past the first lease: the second one holds
    busy = await store.claim(S, "k", "b", 30)
    assert busy.verdict is Verdict.BUSY and busy.expires_in > 20


async def test_a_window_runs_out(store: Store) -> None:
    await store.claim(S, "k", "a", 30)
    await store.done(S, "k", "a", 0.2)
    assert (await store.claim(S, "k", "b", 30)).verdict is Verdict.DUPLICATE
    assert (await wait_for(store, "k", "b", Verdict.CLAIMED)).verdict is Verdict.CLAIMED


async def test_one_batch_applies_its_calls_in_order(store: Store) -> None:
    calls = [("a", "t1"), ("b", "t1"), ("a", "t2"), ("a", "t1")]
    verdicts = await asyncio.gather(*(store.claim(S, key, token, 30) for key, token in calls))
    assert [v.verdict for v in verdicts] == [Verdict.CLAIMED, Verdict.CLAIMED, Verdict.BUSY,
                                             Verdict.CLAIMED]


async def test_what_is_done_outlives_the_connection(tmp_path: Path) -> None:
    first = open_store(url(tmp_path / "keys.db"))
    await first.open()
    await first.done(S, "k", "a", 60)
    await first.claim(S, "held", "a", 60)
    await first.close()
    second = open_store(url(tmp_path / "keys.db"))
    await second.open()
    try:
        assert await second.claim(S, "k", "b", 30) == Claim(Verdict.DUPLICATE)
        assert (await second.claim(S, "held", "b", 30)).verdict is Verdict.BUSY
    finally:
        await second.close()
    with sqlite3.connect(tmp_path / "keys.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_expired_rows_are_swept_now_and_then_not_per_message(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rows() -> int:
        with sqlite3.connect(tmp_path / "keys.db") as db:
            return int(db.execute(f"SELECT count(*) FROM {sqlite_store.TABLE}").fetchone()[0])

    await store.claim(S, "first", "a", 30)  # the first claim of a process sweeps: none yet
    await store.done(S, "old", "a", 0.1)
    await store.claim(S, "gone", "a", 0.1)
    await asyncio.sleep(0.3)
    await store.claim(S, "new", "a", 30)
    assert rows() == 4  # within SWEEP_EVERY of the last sweep: left alone
    monkeypatch.setattr(sqlite_store, "SWEEP_EVERY", 0.0)
    await store.claim(S, "newer", "a", 30)
    assert rows() == 3  # first, new, newer


async def test_the_event_loop_goes_on_while_another_process_holds_the_file(
    store: Store, tmp_path: Path
) -> None:
    other = sqlite3.connect(tmp_path / "keys.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the write lock, as another worker's transaction would
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        claim = asyncio.create_task(store.claim(S, "k", "a", 30))
        await asyncio.sleep(0.3)
        assert not claim.done() and ticks > 5  # waiting on the lock, on the store's thread
        other.execute("ROLLBACK")
        assert (await asyncio.wait_for(claim, 10)).verdict is Verdict.CLAIMED
    finally:
        ticker.cancel()
        other.close()


@pytest.mark.parametrize(
    ("form", "where"),
    [("sqlite:///{rel}", "relative"), ("sqlite:///{abs}", "absolute")],
)
async def test_relative_and_absolute_paths(
    form: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    store = open_store(form.format(rel="sub/keys.db", abs=tmp_path / "sub" / "keys.db"))
    assert store.url.startswith("sqlite:///")
    await store.open()
    await store.done(S, "k", "a", 60)
    await store.close()
    assert (tmp_path / "sub" / "keys.db").is_file(), where


async def test_an_in_memory_store_works() -> None:
    store = open_store("sqlite:///:memory:")
    await store.open()
    try:
        assert (await store.claim(S, "k", "a", 30)).verdict is Verdict.CLAIMED
        assert (await store.claim(S, "k", "b", 30)).verdict is Verdict.BUSY
    finally:
        await store.close()


@pytest.mark.parametrize("bad", ["sqlite://keys.db", "sqlite:", "sqlite://", "sqlite:///"])
def test_a_url_without_a_path_is_refused(bad: str) -> None:
    with pytest.raises(InputError, match="expected sqlite:///PATH"):
        open_store(bad)


def test_a_path_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist") as caught:
        open_store(url(tmp_path / "nowhere" / "keys.db"))
    assert str(tmp_path / "nowhere") in str(caught.value)


@pytest.mark.parametrize("what", ["a directory", "not a database"])
async def test_a_file_sqlite_cannot_use_is_one_line(what: str, tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    if what == "a directory":
        path.mkdir()
    else:
        path.write_bytes(b"this is not an SQLite file, but long enough to look like one\n" * 20)
    store = open_store(url(path))
    with pytest.raises(BrokerError) as caught:
        await store.open()
    text = str(caught.value)
    assert text.startswith(f"idempotency store {url(path)}: ") and "\n" not in text, text
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    await store.close()


# Several processes, one file: each key is claimed by exactly one of them.

PROCESSES = 4
KEYS = [f"k{i}" for i in range(200)]


def claim_all(path: str, token: str, start: threading.Barrier) -> list[str]:
    async def run() -> list[str]:
        store = open_store(f"sqlite:///{path}")
        await store.open()
        keys = random.Random(token).sample(KEYS, len(KEYS))
        start.wait()
        won = []
        try:
            # One key at a time (a transaction each) for the most interleaving, then the rest
            # as one batch (one transaction for many).
            for key in keys[:100]:
                if (await store.claim(S, key, token, 60)).verdict is Verdict.CLAIMED:
                    won.append(key)
            rest = await asyncio.gather(*(store.claim(S, key, token, 60) for key in keys[100:]))
            won += [key for key, c in zip(keys[100:], rest, strict=True)
                    if c.verdict is Verdict.CLAIMED]
        finally:
            await store.close()
        return won

    return asyncio.run(run())


def test_several_processes_claim_each_key_exactly_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no loop inherited
    path = str(tmp_path / "keys.db")
    with context.Manager() as manager, context.Pool(PROCESSES) as pool:
        start = manager.Barrier(PROCESSES)  # all open, then all go at once
        results = [pool.apply_async(claim_all, (path, f"worker-{n}", start))
                   for n in range(PROCESSES)]
        won = [result.get(timeout=120) for result in results]
    assert Counter(key for keys in won for key in keys) == Counter(KEYS)
    assert sum(1 for keys in won if keys) > 1, "one process took every key: no race happened"
