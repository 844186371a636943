"""Running consumers: startup check, reconnects, graceful shutdown, the public entry points.

- One plain connection per runner; everything that lives on it is a ``Session``: each
  consumer's channel with QoS ``prefetch`` (also how many deliveries it handles at once) and
  one confirming channel for retry and parked copies.
- The first connection and topology check are not retried: a worker that cannot start says
  why in one line and exits 1. Except on a cluster, an object whose node is down (it exists,
  but the broker cannot reach it): the worker waits for it with backoff, logged once.
- After that, a lost connection or channel drops the stale deliveries (the broker requeues
  them), reconnects with capped exponential backoff and resumes consuming; an outage is
  logged when it starts and when it ends, not per attempt.
- SIGTERM / SIGINT: cancel the consumers so nothing new arrives, let in-flight handlers finish
  within the grace period, then close. Whatever did not finish is not acked and goes back to
  the broker. A second signal stops at once.
- Traces: whether the worker makes spans is decided once, after ``on_start`` (where an
  application may set up OpenTelemetry), by ``rabbit_retry.tracing.active``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiormq.exceptions
from aiormq.abc import AbstractConnection

from rabbit_retry.backoff import Backoff
from rabbit_retry.broker.absence import is_missing
from rabbit_retry.broker.connect import CONNECTION_ERRORS, connect_amqp, rebuild_pause
from rabbit_retry.errors import BrokerError, InputError, NodeDownError, RabbitRetryError
from rabbit_retry.settings import Settings, mask
from rabbit_retry.text import numbered
from rabbit_retry.topology import naming
from rabbit_retry.topology.apart import load_topology_apart
from rabbit_retry.topology.resolved import Topology
from rabbit_retry.worker.consumer import (
    RetryConsumer,
    check_consumer,
    handler_call,
    is_blocking,
)
from rabbit_retry.worker.metrics import Metrics, Probes
from rabbit_retry.worker.pause import Breaker
from rabbit_retry.worker.session import Session, Subscription

if TYPE_CHECKING:
    from rabbit_retry.worker.stores import Store
    from rabbit_retry.worker.tracing import Tracing

log = logging.getLogger("rabbit_retry.worker")

DEFAULT_GRACE = 30.0
HEARTBEAT = 1.0  # how often the event loop notes that it turns
LIVE_WITHIN = 30.0  # /healthz fails once it has not for this long


class StartError(RabbitRetryError):
    """A consumer's ``on_start`` failed: the worker does not consume (exit code 1)."""
RECONNECT_INITIAL = 0.5
RECONNECT_MAX = 30.0


def subscribe(
    consumers: Sequence[RetryConsumer[Any]], topology: Topology, metrics: Metrics
) -> list[Subscription]:
    """Check every consumer and find its queue in the topology; ``InputError`` names the first
    problem in one line."""
    if not consumers:
        raise InputError("no consumer to run")
    subscriptions = []
    for consumer in consumers:
        adapter = check_consumer(consumer)
        try:
            config = topology.queue(consumer.queue)
        except KeyError:
            known = ", ".join(topology.queue_names)
            raise InputError(
                f"{consumer.name}.queue = {consumer.queue!r} is not a queue in {topology.source}"
                f" (it has: {known})"
            ) from None
        threads = None
        if consumer.batch is None and is_blocking(consumer):
            from concurrent.futures import ThreadPoolExecutor  # only blocking handlers need it

            threads = ThreadPoolExecutor(
                consumer.prefetch, thread_name_prefix=f"rabbit-retry-{consumer.name}"
            )
        subscriptions.append(
            Subscription(
                consumer=consumer,
                config=config,
                adapter=adapter,
                metrics=metrics.for_queue(config.name),
                retry_exchange=naming.retry_exchange(config.name),
                parking_queue=naming.parking_queue(config.name),
                call=handler_call(consumer, threads),
                threads=threads,
                breaker=Breaker(consumer.pause) if consumer.pause is not None else None,
            )
        )
    return subscriptions


async def check_objects(
    connection: AbstractConnection, subscriptions: Sequence[Subscription], hint: str
) -> dict[str, int]:
    """Passively declare everything the consumers need; one line naming what is missing.
    Returns, per ordered queue, the lanes to consume (``lanes_on_broker``).

    One channel for all of it: a failed passive declare closes its channel, but the first
    failure ends the check anyway."""
    channel = await connection.channel(publisher_confirms=False)
    try:
        for sub in subscriptions:
            wanted = [("queue", sub.queue), ("exchange", sub.retry_exchange)]
            wanted += [("queue", naming.tier_queue(sub.queue, ms))
                       for ms in sub.config.retry.tiers_ms]
            wanted.append(("queue", sub.parking_queue))
            if sub.config.ordered is not None:
                wanted.append(("exchange", naming.lanes_exchange(sub.queue)))
                for lane in range(sub.config.ordered.lanes):
                    wanted += [("queue", naming.lane_queue(sub.queue, lane)),
                               ("queue", naming.held_queue(sub.queue, lane))]
            for kind, name in wanted:
                try:
                    if kind == "queue":
                        await channel.queue_declare(name, passive=True)
                    else:
                        await channel.exchange_declare(name, passive=True)
                except aiormq.exceptions.ChannelNotFoundEntity as exc:
                    if not is_missing(str(exc)):
                        raise NodeDownError(
                            f"{kind} {name!r} exists but its node does not answer "
                            f"({mask(str(exc))})"
                        ) from None
                    raise BrokerError(_missing(kind, name, sub, hint)) from None
                except aiormq.exceptions.ChannelAccessRefused as exc:
                    raise BrokerError(f"{kind} {name!r}: access refused ({exc})") from None
    finally:
        if not channel.is_closed:
            await channel.close()
    return {sub.queue: await lanes_on_broker(connection, sub.queue, sub.config.ordered.lanes)
            for sub in subscriptions if sub.config.ordered is not None}


async def lanes_on_broker(connection: AbstractConnection, queue: str, lanes: int) -> int:
    """The file's ``lanes``, and those past them still on the broker while ``migrate`` takes
    them away (it takes the last one away at a time, and its marker is there until it has
    deleted it): they go on with the keys they hold until it deletes them. (Lanes ``migrate``
    added run on workers with the new file.)"""
    count = lanes
    while await _exists(connection, naming.lane_queue(queue, count)):
        count += 1
    if count > lanes and await _exists(connection,
                                       naming.lanes_change_queue(queue, count, count - 1)):
        return count
    if count > lanes:
        log.warning("queue=%s has %d lanes on the broker, %d in this worker's file: it consumes "
                    "%s only; the keys of %s wait for a worker with the file of %d lanes (or "
                    "run `rabbit-retry migrate` with this file first: it takes them away)",
                    queue, count, lanes, numbered("lane", 0, lanes),
                    numbered("lane", lanes, count), count,
                    extra={"queue": queue, "event": "lanes_past_file"})
    return lanes


async def _exists(connection: AbstractConnection, queue: str) -> bool:
    channel = await connection.channel(publisher_confirms=False)
    try:
        await channel.queue_declare(queue, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        if not channel.is_closed:
            await channel.close()
    return True


def _missing(kind: str, name: str, sub: Subscription, hint: str) -> str:
    """What to run when ``name`` is missing: ``apply``, or ``migrate`` for a lane past the
    ones the broker has (every earlier lane was found), which ``apply`` would refuse."""
    lanes = sub.config.ordered.lanes if sub.config.ordered is not None else 0
    have = next((lane for lane in range(1, lanes)
                 if name in (naming.lane_queue(sub.queue, lane),
                             naming.held_queue(sub.queue, lane))), None)
    if have is None:
        return (f"{kind} {name!r} does not exist on the broker; run `rabbit-retry apply {hint}` "
                "first")
    return (f"{kind} {name!r} does not exist on the broker: the file gives {sub.queue} {lanes} "
            f"lanes, the broker {have}; run `rabbit-retry migrate {hint}` first (it adds lanes "
            f"to a live ordered queue), or, if migrate took lanes away, run this worker with "
            f"the file of {have} lanes")


async def _connect_worker(settings: Settings) -> AbstractConnection:
    return await connect_amqp(settings, name="rabbit-retry worker")


class Runner:
    """Runs consumers until stopped; see the module docstring for the guarantees."""

    def __init__(
        self,
        consumers: Sequence[RetryConsumer[Any]],
        *,
        topology: Topology | str | Path,
        settings: Settings | None = None,
        grace: float = DEFAULT_GRACE,
        metrics: Metrics | None = None,
        metrics_port: int | None = None,
        metrics_addr: str = "0.0.0.0",
        ready_when_paused: bool = False,
        connect: Callable[[Settings], Awaitable[AbstractConnection]] | None = None,
        tracing: bool | None = None,
    ) -> None:
        """``connect`` opens each connection the runner uses (default: ``connect_amqp`` to
        ``settings``); ``rabbit_retry.testing`` passes its in-memory broker's. ``tracing``:
        None traces when OpenTelemetry's global tracer provider is set (README, "Traces"),
        False never, True always (an ``InputError`` without the ``otel`` extra)."""
        if isinstance(topology, str | Path):
            self.hint = str(topology)
            topology = load_topology_apart(topology)
        else:
            self.hint = topology.source
        self.settings = settings or Settings.from_env()
        self.grace = grace
        self.metrics = metrics or Metrics()
        self.subscriptions = subscribe(consumers, topology, self.metrics)
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.user = self.settings.user
        self.ready_when_paused = ready_when_paused
        self.connect = connect or _connect_worker
        self.tracing = tracing
        self.trace: Tracing | None = None  # set as run() starts, when the process traces
        self.ready = asyncio.Event()  # consuming (cleared while reconnecting)
        self._beat = time.monotonic()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()

    def stop(self) -> None:
        """Graceful stop; a second call stops without waiting for in-flight handlers."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    async def _open(self) -> Session:
        connection = await self.connect(self.settings)
        try:
            lanes = await check_objects(connection, self.subscriptions, self.hint)
            session = Session(connection, self.subscriptions, self.user, self.trace, lanes)
            await session.start()
        except BaseException:
            with suppress(Exception):
                await connection.close()
            raise
        return session

    async def _first_open(self) -> Session | None:
        """``_open``, waiting out a node that is down (NodeDownError); None if stopped."""
        backoff = Backoff(RECONNECT_INITIAL, RECONNECT_MAX)
        waiting_since: float | None = None
        while True:
            try:
                session = await self._open()
            except NodeDownError as exc:
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    log.warning("%s; waiting for it", exc, extra={"event": "node_down"})
                await self._sleep_unless_stopped(backoff.failed())
                if self._stop.is_set():
                    return None
                continue
            if waiting_since is not None:
                log.warning("the node is back after %.1fs; consuming",
                            time.monotonic() - waiting_since, extra={"event": "node_back"})
            return session

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _reconnect(self, why: str) -> Session | None:
        log.warning(
            "lost the broker (%s); reconnecting with backoff",
            why,
            extra={"event": "connection_lost"},
        )
        started = time.monotonic()
        last_error = ""
        attempts = 0
        backoff = Backoff(RECONNECT_INITIAL, RECONNECT_MAX)
        pause = rebuild_pause(why)
        if pause is not None:  # migrate deletes the queue it rebuilds while we are away
            await self._sleep_unless_stopped(pause)
        while True:
            if self._stop.is_set():
                return None
            attempts += 1
            try:
                session = await self._open()
                break
            except CONNECTION_ERRORS as exc:
                text = mask(str(exc)) or type(exc).__name__
                if text != last_error:  # once per distinct reason, never per attempt
                    log.warning("still reconnecting: %s", text, extra={"event": "reconnect_failed"})
                    last_error = text
            await self._sleep_unless_stopped(backoff.failed())
        log.warning(
            "reconnected after %.1fs (%d attempt(s)); consuming again",
            time.monotonic() - started,
            attempts,
            extra={"event": "reconnected"},
        )
        return session

    async def run(self) -> None:
        """Start the consumers (``on_start``), connect, check the topology, consume until
        ``stop()``; reconnect after losses; stop the consumers (``on_stop``).

        The first connection and check are not retried: a worker that cannot start says why
        and exits (``BrokerError``, exit code 1).
        """
        if self.metrics_port is not None:
            probes = Probes(self._live, self._ready)
            self.metrics_port = self.metrics.serve(self.metrics_port, self.metrics_addr, probes)
            log.info("metrics on http://%s:%d/metrics (probes: /healthz, /readyz)",
                     self.metrics_addr, self.metrics_port)
        heartbeat = asyncio.create_task(self._heartbeat())
        started: list[RetryConsumer[Any]] = []
        stores: dict[str, Store] = {}
        session: Session | None = None
        try:
            await self._start_consumers(started)
            self._start_tracing()
            stores = await self._open_stores()
            session = await self._first_open()
            session = await self._consume(session)
        finally:
            self.ready.clear()
            if session is not None:  # cancelled from outside: close without waiting
                await session.close()
            for sub in self.subscriptions:
                if sub.threads is not None:  # a timed-out blocking handler may still run
                    sub.threads.shutdown(wait=False, cancel_futures=True)
            if stores:
                from rabbit_retry.worker.dedupe import close_stores

                await close_stores(stores)
            await self._stop_consumers(started)
            heartbeat.cancel()
            self.metrics.close()
        log.info("stopped")

    async def _consume(self, session: Session | None) -> Session | None:
        """Until stopped: consume on ``session``, and on a new one whenever it is lost."""
        while session is not None:
            self.ready.set()
            stop_wait: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({session.lost, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
            self.ready.clear()
            if self._stop.is_set():
                await session.shutdown(self.grace, self._force)
                return None
            why = session.lost.result()
            await session.close()
            session = None
            session = await self._reconnect(why)
        return None

    def _start_tracing(self) -> None:
        from rabbit_retry import tracing

        if not tracing.active(self.tracing):
            return
        from rabbit_retry.worker.tracing import Tracing, trace_id

        self.trace = Tracing()
        self.metrics.keep_exemplars(trace_id)
        log.info("tracing: a span per delivery to OpenTelemetry's tracer provider",
                 extra={"event": "tracing"})

    async def _start_consumers(self, started: list[RetryConsumer[Any]]) -> None:
        for consumer in dict.fromkeys(sub.consumer for sub in self.subscriptions):
            try:
                await consumer.on_start()
            except Exception as exc:
                raise StartError(f"{consumer.name}.on_start failed: "
                                 f"{type(exc).__name__}: {mask(str(exc))}") from exc
            started.append(consumer)

    @staticmethod
    async def _stop_consumers(started: list[RetryConsumer[Any]]) -> None:
        for consumer in reversed(started):
            try:
                await consumer.on_stop()
            except Exception:  # the others still get to close theirs
                log.exception("%s.on_stop failed", consumer.name)

    async def _open_stores(self) -> dict[str, Store]:
        """Open the idempotency stores the consumers declare, and give each its ``Deduper``."""
        rules = {
            id(sub): sub.consumer.idempotency
            for sub in self.subscriptions
            if sub.consumer.idempotency is not None
        }
        if not rules:
            return {}
        from rabbit_retry.worker.dedupe import Deduper, open_stores  # only for Idempotency

        stores = await open_stores(rules)
        self.subscriptions = [
            replace(sub, deduper=Deduper(
                rule, stores[rule.store], sub.queue, sub.consumer.name,
                sub.consumer.handler_timeout, self.user,
                batch_wait=sub.consumer.batch.wait if sub.consumer.batch is not None else 0.0))
            if (rule := sub.consumer.idempotency) is not None
            else sub
            for sub in self.subscriptions
        ]
        return stores

    async def _heartbeat(self) -> None:
        """The event loop's pulse, which ``/healthz`` reads from the server's thread."""
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(HEARTBEAT)

    def _live(self) -> tuple[bool, str]:
        """``/healthz``: the process is alive and its event loop turns (a handler that blocks
        the loop, a deadlock: restart it)."""
        silent = time.monotonic() - self._beat
        if silent > LIVE_WITHIN:
            return False, f"the event loop has not run for {silent:.0f}s"
        return True, "alive"

    def _ready(self) -> tuple[bool, str]:
        """``/readyz``: connected and consuming every queue (a paused queue only counts as
        ready with ``ready_when_paused``)."""
        if not self.ready.is_set():
            return False, "not consuming: connecting to the broker"
        paused = [sub.queue for sub in self.subscriptions
                  if sub.breaker is not None and sub.breaker.paused]
        if paused and not self.ready_when_paused:
            return False, f"paused (its downstream fails): {', '.join(paused)}"
        return True, "consuming"


async def run_consumers(
    consumers: Sequence[RetryConsumer[Any]],
    *,
    topology: Topology | str | Path,
    settings: Settings | None = None,
    grace: float = DEFAULT_GRACE,
    metrics_port: int | None = None,
    metrics_addr: str = "0.0.0.0",
    handle_signals: bool = True,
    ready_when_paused: bool = False,
) -> None:
    """Run ``consumers`` in this process until SIGTERM / SIGINT (or cancellation).

    ``topology`` is the file the provisioner applied (or its loaded ``Topology``); each
    consumer's retry policy comes from its queue there. Without ``metrics_port`` nothing can
    read the runner's metrics, so they are kept without prometheus-client.
    """
    runner = Runner(
        consumers,
        topology=topology,
        settings=settings,
        grace=grace,
        metrics=Metrics(exported=False) if metrics_port is None else None,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
        ready_when_paused=ready_when_paused,
    )
    loop = asyncio.get_running_loop()
    installed = []
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with suppress(NotImplementedError, RuntimeError):  # not main thread / Windows
                loop.add_signal_handler(sig, runner.stop)
                installed.append(sig)
    try:
        await runner.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(
    consumers: Sequence[RetryConsumer[Any]],
    *,
    topology: Topology | str | Path,
    settings: Settings | None = None,
    grace: float = DEFAULT_GRACE,
    metrics_port: int | None = None,
    metrics_addr: str = "0.0.0.0",
    handle_signals: bool = True,
    ready_when_paused: bool = False,
) -> None:
    """Blocking form of :func:`run_consumers`, for a ``main()``."""
    asyncio.run(
        run_consumers(
            consumers,
            topology=topology,
            settings=settings,
            grace=grace,
            metrics_port=metrics_port,
            metrics_addr=metrics_addr,
            handle_signals=handle_signals,
            ready_when_paused=ready_when_paused,
        )
    )
