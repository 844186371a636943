"""The three idempotency stores against the real servers (SQLite file, PostgreSQL, Redis):
the verdict table, claims racing from several connections, expiry, and errors a user reads."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from support.stores import POSTGRES_URL, REDIS_URL

from rabbit_retry.errors import InputError, RabbitRetryError
from rabbit_retry.worker.stores import Store, Verdict, open_store

POSTGRES, REDIS = POSTGRES_URL, REDIS_URL


def url_of(kind: str, tmp_path: Path) -> str:
    return {"sqlite": f"sqlite:///{tmp_path / 'keys.db'}", "postgresql": POSTGRES,
            "redis": REDIS}[kind]


@pytest.fixture(params=["sqlite", "postgresql", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(kind: str, tmp_path: Path) -> AsyncIterator[Store]:
    opened = open_store(url_of(kind, tmp_path))
    await opened.open()
    yield opened
    await opened.close()


@pytest.fixture
def scope() -> str:
    # The servers outlive the test: a scope of its own keeps runs apart.
    return f"test-{uuid.uuid4().hex[:12]}"


async def test_the_verdicts(store: Store, scope: str) -> None:
    assert (await store.claim(scope, "k", "a", 30)).verdict is Verdict.CLAIMED
    assert (await store.claim(scope, "k", "a", 30)).verdict is Verdict.CLAIMED  # its holder
    busy = await store.claim(scope, "k", "b", 30)
    assert busy.verdict is Verdict.BUSY and 0 < busy.expires_in <= 30
    await store.release(scope, "k", "b")  # not b's to release
    assert (await store.claim(scope, "k", "b", 30)).verdict is Verdict.BUSY
    await store.release(scope, "k", "a")
    assert (await store.claim(scope, "k", "b", 30)).verdict is Verdict.CLAIMED
    await store.done(scope, "k", "b", 60)
    assert (await store.claim(scope, "k", "c", 30)).verdict is Verdict.DUPLICATE
    await store.release(scope, "k", "b")  # a done key stays done
    assert (await store.claim(scope, "k", "c", 30)).verdict is Verdict.DUPLICATE
    assert (await store.claim(scope + "-other", "k", "c", 30)).verdict is Verdict.CLAIMED


async def test_a_lease_and_a_window_run_out(store: Store, scope: str) -> None:
    assert (await store.claim(scope, "held", "dead", 0.3)).verdict is Verdict.CLAIMED
    await store.done(scope, "done", "x", 0.3)
    assert (await store.claim(scope, "held", "live", 30)).verdict is Verdict.BUSY
    assert (await store.claim(scope, "done", "live", 30)).verdict is Verdict.DUPLICATE
    # Each runs out on its own: the window began after the lease, by as long as the calls
    # between took (on a loaded CI machine the window was still on when the lease had gone).
    for key in ("held", "done"):
        for _ in range(100):  # a generous bound; usually the first look after 0.3 s
            got = await store.claim(scope, key, "live", 30)
            if got.verdict is Verdict.CLAIMED:
                break
            await asyncio.sleep(0.1)
        assert got.verdict is Verdict.CLAIMED, key


async def test_racing_claims_from_several_connections_give_each_key_to_one(
    kind: str, tmp_path: Path, scope: str
) -> None:
    stores = [open_store(url_of(kind, tmp_path)) for _ in range(4)]
    for s in stores:
        await s.open()
    try:
        keys = [f"k{i}" for i in range(50)]
        claims = [(s, key, f"t{n}") for n, s in enumerate(stores) for key in keys]
        verdicts = await asyncio.gather(*(s.claim(scope, key, token, 30)
                                          for s, key, token in claims))
        won = Counter(key for (_, key, _), v in zip(claims, verdicts, strict=True)
                      if v.verdict is Verdict.CLAIMED)
        assert won == Counter({key: 1 for key in keys})
        assert all(v.verdict in (Verdict.CLAIMED, Verdict.BUSY) for v in verdicts)
    finally:
        for s in stores:
            await s.close()


async def test_one_key_twice_in_one_batch_is_claimed_once(store: Store, scope: str) -> None:
    # Concurrent calls on one store travel in one batch (one transaction or round trip).
    verdicts = await asyncio.gather(*(store.claim(scope, key, token, 30) for key, token in
                                      [("a", "t1"), ("b", "t1"), ("a", "t2"), ("a", "t3")]))
    assert [v.verdict for v in verdicts] == [Verdict.CLAIMED, Verdict.CLAIMED, Verdict.BUSY,
                                             Verdict.BUSY]
    await asyncio.gather(store.done(scope, "a", "t1", 60), store.release(scope, "b", "t1"))
    again = await asyncio.gather(store.claim(scope, "a", "t4", 30), store.claim(scope, "b", "t4",
                                                                               30))
    assert [v.verdict for v in again] == [Verdict.DUPLICATE, Verdict.CLAIMED]


async def test_racing_batches_in_different_orders_neither_deadlock_nor_share_a_key(
    kind: str, tmp_path: Path, scope: str
) -> None:
    # Each store's concurrent calls travel as one batch (one transaction): two batches meeting
    # the same keys in opposite orders must not lock each other out.
    stores = [open_store(url_of(kind, tmp_path)) for _ in range(2)]
    for s in stores:
        await s.open()
    try:
        for round_ in range(30):  # a deadlock needs the two to interleave: give it chances
            keys = [f"r{round_}-k{i}" for i in range(100)]
            orders = [keys, keys[::-1]]
            claims = [(s, key, f"t{n}") for n, s in enumerate(stores) for key in orders[n]]
            verdicts = await asyncio.gather(*(s.claim(scope, key, token, 30)
                                              for s, key, token in claims))
            won = Counter(key for (_, key, _), v in zip(claims, verdicts, strict=True)
                          if v.verdict is Verdict.CLAIMED)
            assert won == Counter(keys)
            await asyncio.gather(*(s.done(scope, key, token, 60) for s, key, token in claims))
            again = await asyncio.gather(*(s.claim(scope, key, "late", 30)
                                           for s, key, _ in claims))
            assert {v.verdict for v in again} == {Verdict.DUPLICATE}
    finally:
        for s in stores:
            await s.close()


async def test_a_done_key_is_a_duplicate_for_the_token_that_did_it_too(
    store: Store, scope: str
) -> None:
    await store.claim(scope, "k", "a", 30)
    await store.done(scope, "k", "a", 60)
    assert (await store.claim(scope, "k", "a", 30)).verdict is Verdict.DUPLICATE


async def test_a_refused_login_says_why_in_one_line() -> None:
    server = urlsplit(POSTGRES)  # the test server, as a user that does not exist there
    store = open_store(f"postgresql://rr:s3cret@{server.hostname}:{server.port or 5432}/nodb")
    with pytest.raises(RabbitRetryError) as caught:
        await store.open()
    text = str(caught.value)
    assert text.startswith("idempotency store postgresql://rr:***@"), text
    assert "does not exist" in text or "authentication" in text, text
    assert "s3cret" not in text and "\n" not in text


def test_a_postgresql_url_it_cannot_parse_is_an_input_error() -> None:
    with pytest.raises(InputError) as caught:
        open_store("postgresql://rr:s3cret@[::1/db")
    assert "s3cret" not in str(caught.value) and "rr:***@" in str(caught.value)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://rr:s3cret@127.0.0.1:1/db", "idempotency store postgresql://rr:***@"),
        ("redis://:s3cret@127.0.0.1:1/0", "idempotency store redis://:***@"),
    ],
)
async def test_an_unreachable_server_is_one_line_without_the_password(url: str,
                                                                      says: str) -> None:
    store = open_store(url)
    with pytest.raises(RabbitRetryError) as caught:
        await store.open()
    text = str(caught.value)
    assert text.startswith(says), text
    assert "s3cret" not in text and "\n" not in text


def test_a_sqlite_path_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RabbitRetryError, match="does not exist"):
        open_store(f"sqlite:///{tmp_path / 'nowhere' / 'keys.db'}")
