"""The one tuple of errors that mean the broker connection failed (broker.connect)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiormq.exceptions
import pytest

from rabbit_retry.broker import connect as connect_module
from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect
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

    monkeypatch.setattr(connect_module.aio_pika, "connect", failing)
    with pytest.raises(BrokerError) as excinfo:
        asyncio.run(connect(Settings(url="amqp://u:secret@h:5672/")))
    assert "secret" not in str(excinfo.value)
    assert excinfo.value.__cause__ is error
