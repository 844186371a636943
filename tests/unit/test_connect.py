"""The one tuple of errors that mean the broker connection failed (broker.connect)."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest

from rabbit_retry.broker import connect as connect_module
from rabbit_retry.broker.connect import (
    CONNECTION_ERRORS,
    REBUILD_PAUSE,
    REBUILD_PAUSE_MAX,
    REBUILDING,
    connect,
    connect_amqp,
    rebuild_pause,
    rebuilding,
)
from rabbit_retry.errors import BrokerError, InputError
from rabbit_retry.settings import Settings

LOST = [
    BrokerError("broker at amqp://h/ is unreachable"),
    aiormq.exceptions.AMQPConnectionError("closed"),
    aiormq.exceptions.ChannelInvalidStateError("connection closed"),
    ConnectionResetError(),
    TimeoutError(),
    RuntimeError("connection closed"),
]


@pytest.mark.parametrize("error", LOST, ids=lambda e: type(e).__name__)
def test_connection_errors_cover_a_lost_or_refused_broker(error: BaseException) -> None:
    assert isinstance(error, CONNECTION_ERRORS)


@pytest.mark.parametrize("error", [InputError("bad file"), ValueError(), KeyError("q")])
def test_connection_errors_leave_mistakes_alone(error: BaseException) -> None:
    assert not isinstance(error, CONNECTION_ERRORS)


@pytest.mark.parametrize("error", LOST[1:], ids=lambda e: type(e).__name__)
def test_connect_turns_each_into_one_broker_error(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    async def failing(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(aio_pika, "connect", failing)
    with pytest.raises(BrokerError) as excinfo:
        asyncio.run(connect(Settings(url="amqp://u:secret@h:5672/")))
    assert "secret" not in str(excinfo.value)
    assert excinfo.value.__cause__ is error


@pytest.mark.parametrize("error", LOST[1:], ids=lambda e: type(e).__name__)
def test_the_workers_aiormq_connect_turns_each_into_one_broker_error(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    async def failing(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(connect_module.aiormq, "connect", failing)
    with pytest.raises(BrokerError) as excinfo:
        asyncio.run(connect_amqp(Settings(url="amqp://u:secret@h:5672/")))
    assert "secret" not in str(excinfo.value)
    assert excinfo.value.__cause__ is error


@pytest.mark.parametrize(
    ("url", "management"),
    [
        ("amqp://guest:guest@127.0.0.1:5999/", "http://guest:guest@127.0.0.1:15672"),
        ("amqps://u:p%40w@rabbit.example:5671/v", "https://u:p%40w@rabbit.example:15671"),
        ("amqp://[::1]:5672/", "http://guest:guest@[::1]:15672"),
        ("amqp://rabbit", "http://guest:guest@rabbit:15672"),
    ],
)
def test_a_management_url_left_unset_follows_the_amqp_url(
    url: str, management: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rabbit_retry.settings import MANAGEMENT_URL_ENV, URL_ENV, Settings

    monkeypatch.delenv(MANAGEMENT_URL_ENV, raising=False)
    monkeypatch.delenv(URL_ENV, raising=False)
    assert Settings.from_env(url).management_url == management
    monkeypatch.setenv(URL_ENV, url)
    assert Settings.from_env().management_url == management
    assert Settings.from_env(url, "http://other:15672").management_url == "http://other:15672"


@pytest.mark.parametrize(
    ("why", "pause"),
    [
        # What a worker sees when migrate closes its connection: the broker's reply text.
        (f"CONNECTION_FORCED - {rebuilding('shop.parking', 2)}", 4.0),
        (f"CONNECTION_FORCED - {rebuilding('shop.parking', 0)}", 1.0),
        (f"CONNECTION_FORCED - {rebuilding('shop.parking', 19)}", REBUILD_PAUSE_MAX),
        (f"CONNECTION_FORCED - {REBUILDING}shop.parking is being rebuilt", REBUILD_PAUSE),
        (f"{REBUILDING}x is being rebuilt; reconnect in 600s", REBUILD_PAUSE_MAX),
        ("CONNECTION_FORCED - Closed via management plugin; reconnect in 9s", None),
        ("connection reset by peer", None),
    ],
)
def test_a_worker_closed_by_migrate_waits_as_long_as_the_reason_asks(
    why: str, pause: float | None
) -> None:
    assert rebuild_pause(why) == pause
