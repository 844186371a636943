"""Opening an AMQP connection to one node or the first of a cluster's nodes that takes it, with
each way it can fail turned into one clear line."""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl

import aiormq
import aiormq.abc
import aiormq.exceptions

from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings, mask, parse_url
from rabbit_retry.wire import keep_header_types

if TYPE_CHECKING:
    from aio_pika.abc import AbstractConnection

_C = TypeVar("_C")

# How ``rabbit-retry migrate`` begins the reason it gives when it closes a connection: a worker
# closed so waits as long as the reason says (``rebuilding``; REBUILD_PAUSE when it names no
# time) before it reconnects, so that migrate deletes the queue it rebuilds (a parking queue the
# worker publishes to included) before the worker is back. Each round migrate needs asks for
# twice the wait of the round before, up to REBUILD_PAUSE_MAX: on a loaded machine the worker
# was back within a second, before the deletion, 20 rounds in a row (CI, 4.0).
REBUILDING = "rabbit-retry migrate: "
REBUILD_PAUSE = 1.0
REBUILD_PAUSE_MAX = 30.0
_PAUSE = re.compile(r"reconnect in (\d+(?:\.\d+)?)s")


def rebuilding(queue: str, attempt: int) -> str:
    """The reason migrate gives when, in its ``attempt``-th round (from 0), it closes a
    connection consuming ``queue`` (or a queue that publishes to it) to rebuild it."""
    pause = min(REBUILD_PAUSE * 2**attempt, REBUILD_PAUSE_MAX)
    return f"{REBUILDING}{queue} is being rebuilt; reconnect in {pause:g}s"


def rebuild_pause(why: str) -> float | None:
    """How long to wait before reconnecting after a close for ``why``: None unless migrate
    closed the connection."""
    if REBUILDING not in why:
        return None
    asked = _PAUSE.search(why)
    return min(float(asked.group(1)), REBUILD_PAUSE_MAX) if asked else REBUILD_PAUSE

# What a broker that is unreachable, refuses us, or goes away while we work raises: our own
# BrokerError (connect() below wraps its failures in it), the client's AMQP errors, socket
# errors and timeouts (ConnectionError and TimeoutError are OSErrors, named for the reader),
# and the RuntimeError aiormq raises for a channel used or opened on a closed connection.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    BrokerError,
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
    RuntimeError,
)


def refused_everywhere(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal every node of one cluster would give alike (credentials,
    permissions, the vhost): trying the next node would only repeat it."""
    if isinstance(
        exc,
        aiormq.exceptions.ProbableAuthenticationError
        | aiormq.exceptions.ChannelAccessRefused
        | aiormq.exceptions.ConnectionNotAllowed,
    ):
        return True
    text = str(exc)
    return "NOT_ALLOWED" in text or "access to vhost" in text or (
        "Connection.OpenOk" in text and "Connection.Close" in text
    )


def describe_connect_error(exc: BaseException, settings: Settings) -> str:
    """One line for the user; never contains the password."""
    from rabbit_retry.tls import describe_tls_error, tls_cause  # a failure's path

    where = settings.safe_url
    tls_error = tls_cause(exc)
    if tls_error is not None:
        return f"TLS handshake with {where} failed: {mask(describe_tls_error(tls_error))}"
    if (closed := _closed_after_tls(exc, settings)) is not None:
        return closed
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
        return f"broker at {where} refused the credentials (wrong user or password)"
    text = mask(str(exc))
    refused = aiormq.exceptions.ChannelAccessRefused | aiormq.exceptions.ConnectionNotAllowed
    if isinstance(exc, refused):
        return f"broker at {where} refused access: {text}"
    # aiormq reports the broker's Connection.Close in answer to Connection.Open (which RabbitMQ
    # sends only to refuse the vhost) as an unexpected frame, without the broker's reason.
    if refused_everywhere(exc) or ("vhost" in text and "not found" in text):
        return (
            f"broker at {where} refused the vhost {settings.vhost!r}: it does not exist or the "
            "user has no access to it"
        )
    return _unreachable(exc, text, settings)


def _closed_after_tls(exc: BaseException, settings: Settings) -> str | None:
    """A TLS 1.3 server refuses a client certificate (or its absence) after the client thinks
    the handshake is done; its alert is often lost to the reset that follows."""
    from rabbit_retry.tls import cause_of

    closed = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, EOFError)
    if not (settings.url.startswith("amqps:") and cause_of(exc, closed)):
        return None
    hint = (
        "did it refuse the client certificate of --cert-file?"
        if settings.cert_file
        else "does it require a client certificate? give --cert-file and --key-file"
    )
    return (f"broker at {settings.safe_url} closed the connection right after the TLS "
            f"handshake: {hint}")


def _unreachable(exc: BaseException, text: str, settings: Settings) -> str:
    """Nothing answered, or not in time, or something else went wrong."""
    from rabbit_retry.tls import cause_of

    where = settings.safe_url
    refused_port = cause_of(exc, OSError)
    if (
        isinstance(exc, ConnectionRefusedError)
        or "Connection refused" in text
        or (refused_port is not None and refused_port.errno == errno.ECONNREFUSED)
    ):
        return f"broker at {where} is unreachable: connection refused"
    if isinstance(exc, TimeoutError):
        if settings.url.startswith("amqps:"):
            # A plain AMQP listener never answers a TLS hello: say so, it is the usual cause.
            return f"broker at {where} did not answer in time (is that port a TLS listener?)"
        return f"broker at {where} did not answer in time"
    if isinstance(exc, OSError):
        return f"broker at {where} is unreachable: {text or type(exc).__name__}"
    return f"cannot connect to {where}: {type(exc).__name__}: {text}"


async def connect(
    settings: Settings,
    *,
    connect_timeout: float = 10.0,
    name: str = "rabbit-retry",
    **kwargs: Any,
) -> AbstractConnection:
    """A plain (not robust) aio-pika connection; the caller owns reconnect policy.

    The nodes of ``settings.urls`` are tried in order; the first that takes the connection is
    used. A refusal every node would repeat (credentials, the vhost) stops at once; otherwise
    the ``BrokerError`` names what each node said, in one line.

    For ``amqps://`` with TLS files in ``settings`` the connection uses their context (an
    unreadable file is an ``InputError`` before anything is sent).
    """
    import aio_pika  # the worker connects with aiormq alone (connect_amqp)

    async def open_node(node: Settings) -> AbstractConnection:
        options = dict(kwargs)
        tls = node.amqp_tls()
        if tls is not None:
            options["ssl_context"] = tls
        connection: AbstractConnection = await aio_pika.connect(
            node.url,
            timeout=connect_timeout,
            client_properties={"connection_name": name},
            **options,
        )
        return connection

    return await _first_node(settings, open_node)


async def connect_amqp(
    settings: Settings, *, connect_timeout: float = 10.0, name: str = "rabbit-retry"
) -> aiormq.abc.AbstractConnection:
    """``connect``, as the bare aiormq connection that aio-pika would wrap: what the worker
    uses, without importing aio-pika. Opened the way ``aio_pika.connect`` opens it."""

    async def open_node(node: Settings) -> aiormq.abc.AbstractConnection:
        tls = node.amqp_tls()
        # The two socket options aio-pika takes from the URL's query; aiormq reads the rest.
        query = dict(parse_qsl(parse_url(node.url).query))
        socket: dict[str, Any] = {}
        if query.get("interleave"):
            socket["interleave"] = int(query["interleave"])
        if query.get("happy_eyeballs_delay"):
            socket["happy_eyeballs_delay"] = float(query["happy_eyeballs_delay"])

        async def opened() -> aiormq.abc.AbstractConnection:
            connection: aiormq.abc.AbstractConnection = await aiormq.connect(
                node.url, client_properties={"connection_name": name}, context=tls, **socket
            )
            await connection.ready()
            return connection

        return await asyncio.wait_for(opened(), connect_timeout)

    return await _first_node(settings, open_node)


async def _first_node(settings: Settings, open_node: Callable[[Settings], Awaitable[_C]]) -> _C:
    # Every header read from here on keeps its AMQP type, so a copy writes it back unchanged.
    keep_header_types()
    failures: list[str] = []
    for node in settings.nodes():
        try:
            try:
                return await open_node(node)
            except CONNECTION_ERRORS as exc:
                raise BrokerError(describe_connect_error(exc, node)) from exc
        except BrokerError as exc:
            if len(settings.urls) == 1:
                raise
            if refused_everywhere(exc.__cause__ or exc):
                # Said of the cluster: every node would say the same.
                raise BrokerError(describe_connect_error(exc.__cause__ or exc, settings)) from exc
            failures.append(str(exc))
    raise BrokerError(f"no node of the cluster took the connection: {'; '.join(failures)}")
