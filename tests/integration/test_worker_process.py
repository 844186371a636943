"""``rabbit-retry worker`` as users run it: a process that stops on SIGTERM without losing a
message, and one-line errors with the exit codes the README lists under "Commands"."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.amqp import depth, drain, publish
from support.poll import eventually
from support.process import CLI
from support.provision import provision, topology

from rabbit_retry.settings import Settings

Q = "orders.fraud-check"

TOPOLOGY = f"""\
version: 1
exchanges:
  orders: {{type: topic}}
queues:
  {Q}:
    bindings: [{{exchange: orders, routing_key: order.created}}]
    retry: {{delays: [300ms, 600ms], max_attempts: 4}}
"""

APP = """\
import asyncio
import os

from rabbit_retry import Delivery, RetryConsumer


def note(name: str, line: str) -> None:
    with open(os.path.join(os.environ["WORK_DIR"], name), "a") as f:
        f.write(line + "\\n")
    with open(os.path.join(os.environ["WORK_DIR"], "events"), "a") as f:
        f.write(name + "\\n")


class Slow(RetryConsumer):
    queue = "orders.fraud-check"
    prefetch = 10
    handler_timeout = 120.0

    async def handle(self, delivery: Delivery) -> None:
        note("started", delivery.message_id)
        await asyncio.sleep(float(os.environ["HANDLER_SECONDS"]))
        note("done", delivery.message_id)
"""


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _events(tmp_path: Path) -> list[str]:
    """``started`` / ``done`` in the order the handlers wrote them, since the last start."""
    events = lines(tmp_path / "events")
    return events[len(events) - 16:]


async def start_worker(
    tmp_path: Path, settings: Settings, *args: str, handler_seconds: float
) -> asyncio.subprocess.Process:
    (tmp_path / "app.py").write_text(APP)
    env = {**os.environ, "WORK_DIR": str(tmp_path), "HANDLER_SECONDS": str(handler_seconds)}
    return await asyncio.create_subprocess_exec(
        CLI,
        "--url",
        settings.url,
        "worker",
        "app:Slow",
        "-t",
        "topology.yml",
        *args,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def setup(tmp_path: Path, settings: Settings, count: int) -> None:
    (tmp_path / "topology.yml").write_text(TOPOLOGY)
    await provision(settings, topology(TOPOLOGY))
    await publish(settings, b"{}", exchange="orders", routing_key="order.created", count=count)


async def test_sigterm_lets_in_flight_handlers_finish_and_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    await setup(tmp_path, fresh_vhost, 30)
    worker = await start_worker(tmp_path, fresh_vhost, "--grace", "30", handler_seconds=1.5)
    await eventually(lambda: len(lines(tmp_path / "started")) >= 10, what="10 in flight")
    worker.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(worker.communicate(), timeout=60)
    assert worker.returncode == 0, err.decode()
    started = lines(tmp_path / "started")
    done = lines(tmp_path / "done")
    left = await depth(fresh_vhost, Q)
    # Every message that started finished and was acked; everything else is still queued.
    assert sorted(done) == sorted(started)
    assert len(set(done)) == len(done)
    assert len(done) + left == 30
    assert "stopping: waiting up to 30s for" in err.decode()
    for suffix in (".retry.300ms", ".retry.600ms", ".parking"):
        assert await depth(fresh_vhost, Q + suffix) == 0


async def test_sigterm_returns_unfinished_messages_to_the_broker_after_the_grace(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    await setup(tmp_path, fresh_vhost, 25)
    worker = await start_worker(tmp_path, fresh_vhost, "--grace", "0.5", handler_seconds=60)
    await eventually(lambda: len(lines(tmp_path / "started")) >= 10, what="10 in flight")
    worker.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(worker.communicate(), timeout=60)
    assert worker.returncode == 0, err.decode()
    assert lines(tmp_path / "done") == []
    assert await depth(fresh_vhost, Q) == 25
    # Ten handlers ran (the prefetch); leaving its first-delivery probation, the worker may have
    # held one more delivery, waiting for a free slot: it goes back too.
    assert len(lines(tmp_path / "started")) == 10
    assert "10 message(s) did not finish within the grace period" in err.decode()
    # Sent back as copies, not left unacked: the next start takes them as fresh deliveries, not
    # as a crash's returns to run one at a time.
    back = {t.message_id: t for t in await drain(fresh_vhost, Q)}
    assert set(back) == {f"m-{n}" for n in range(25)}
    for message_id in lines(tmp_path / "started"):
        assert not back[message_id].redelivered
        assert not back[message_id].headers.get("x-delivery-count")  # 3.10 writes a 0


async def test_messages_cut_off_by_a_stop_run_at_full_concurrency_on_the_next_start(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    """Eight messages of three seconds, a stop past the grace, a start: all eight run at once
    (before, they came back as returns and ran one at a time: 18 s instead of about 6)."""
    await setup(tmp_path, fresh_vhost, 8)
    worker = await start_worker(tmp_path, fresh_vhost, "--grace", "0.2", handler_seconds=3)
    await eventually(lambda: len(lines(tmp_path / "started")) == 8, what="8 in flight")
    worker.send_signal(signal.SIGTERM)
    await asyncio.wait_for(worker.communicate(), timeout=60)
    (tmp_path / "started").unlink()
    worker = await start_worker(tmp_path, fresh_vhost, "--grace", "30", handler_seconds=3)
    try:
        await eventually(lambda: len(lines(tmp_path / "done")) == 8, within=60, what="8 done")
        # All eight had started before the first one finished: they ran side by side.
        assert len(lines(tmp_path / "started")) == 8
        order = _events(tmp_path)
        assert order[:8] == ["started"] * 8, order
    finally:
        worker.send_signal(signal.SIGTERM)
        await asyncio.wait_for(worker.communicate(), timeout=60)


async def test_second_signal_stops_at_once(fresh_vhost: Settings, tmp_path: Path) -> None:
    await setup(tmp_path, fresh_vhost, 5)
    worker = await start_worker(tmp_path, fresh_vhost, "--grace", "300", handler_seconds=300)
    await eventually(lambda: len(lines(tmp_path / "started")) >= 5, what="5 in flight")
    worker.send_signal(signal.SIGINT)
    await asyncio.sleep(0.5)
    worker.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(worker.communicate(), timeout=60)
    assert worker.returncode == 0, err.decode()
    assert await depth(fresh_vhost, Q) == 5


async def test_json_logs_set_from_the_environment_carry_each_decision(
    fresh_vhost: Settings, tmp_path: Path
) -> None:
    """Every option from the environment (as a Kubernetes deployment sets them), JSON logs: one
    object per line with the decision's fields; never a body."""
    (tmp_path / "topology.yml").write_text(TOPOLOGY)
    await provision(fresh_vhost, topology(TOPOLOGY))
    (tmp_path / "app.py").write_text(APP + """

class Declines(Slow):
    async def handle(self, delivery: Delivery) -> None:
        from rabbit_retry import Permanent

        raise Permanent(f"card declined for {delivery.message_id}")
""")
    env = {**os.environ, "WORK_DIR": str(tmp_path), "HANDLER_SECONDS": "0",
           "RABBIT_RETRY_URL": fresh_vhost.url, "RABBIT_RETRY_CONSUMERS": "app:Declines",
           "RABBIT_RETRY_TOPOLOGY": "topology.yml", "RABBIT_RETRY_LOG_FORMAT": "json",
           "RABBIT_RETRY_GRACE": "1"}
    worker = await asyncio.create_subprocess_exec(
        CLI, "worker", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        await publish(fresh_vhost, b'{"secret": "card 4111"}', exchange="orders",
                      routing_key="order.created", message_id="o-1")
        await eventually(lambda: depth_is(fresh_vhost, Q + ".parking", 1), what="parked")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(worker.communicate(), timeout=60)
    records = [json.loads(line) for line in err.decode().splitlines()]
    [parked] = [r for r in records if r.get("outcome") == "parked"]
    assert parked["level"] == "warning" and parked["logger"] == "rabbit_retry.worker"
    assert (parked["queue"], parked["message_id"], parked["attempt"]) == (Q, "o-1", 1)
    assert parked["reason"] == "permanent"
    assert parked["exception_type"] == "rabbit_retry.worker.consumer.Permanent"
    assert parked["exception_message"] == "card declined for o-1"
    assert any(r.get("event") == "consuming" for r in records)
    assert "4111" not in err.decode()


async def depth_is(settings: Settings, queue: str, count: int) -> bool:
    return await depth(settings, queue) == count


# --- one-line errors -----------------------------------------------------------------------------


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` as the current directory, with imports of ``app`` isolated to this test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "app", raising=False)
    yield tmp_path
    sys.modules.pop("app", None)


def test_missing_topology_objects_exit_1_naming_them(
    fresh_vhost: Settings, app_dir: Path, run_cli: Callable[..., Any]
) -> None:
    tmp_path = app_dir
    path = tmp_path / "topology.yml"
    path.write_text(TOPOLOGY)
    (tmp_path / "app.py").write_text(APP)
    result = run_cli("worker", "app:Slow", "-t", str(path), settings=fresh_vhost)
    assert result.code == 1
    assert result.err == (
        f"error: queue '{Q}' does not exist on the broker; run `rabbit-retry apply {path}` first\n"
    )


def test_bad_consumer_reference_exits_2(
    session_vhost: Settings, app_dir: Path, run_cli: Callable[..., Any]
) -> None:
    tmp_path = app_dir
    path = tmp_path / "topology.yml"
    path.write_text(TOPOLOGY)
    (tmp_path / "app.py").write_text(APP + "\n\nclass NotAConsumer:\n    pass\n")
    cases = {
        "nowhere:Slow": "error: 'nowhere:Slow': no module named 'nowhere'\n",
        "app": "error: 'app': expected MODULE:CLASS, e.g. app.consumers:FraudCheck\n",
        "app:Missing": "error: 'app:Missing': module 'app' has no 'Missing'\n",
        "app:NotAConsumer": "error: 'app:NotAConsumer': NotAConsumer is not a RetryConsumer"
        " subclass\n",
    }
    for spec, expected in cases.items():
        result = run_cli("worker", spec, "-t", str(path), settings=session_vhost)
        assert (result.code, result.err) == (2, expected), spec


def test_consumer_of_a_queue_missing_from_the_file_exits_2(
    session_vhost: Settings, app_dir: Path, run_cli: Callable[..., Any]
) -> None:
    tmp_path = app_dir
    path = tmp_path / "topology.yml"
    path.write_text(TOPOLOGY.replace(Q, "orders.other"))
    (tmp_path / "app.py").write_text(APP)
    result = run_cli("worker", "app:Slow", "-t", str(path), settings=session_vhost)
    assert result.code == 2
    assert result.err == (
        f"error: Slow.queue = '{Q}' is not a queue in {path} (it has: orders.other)\n"
    )


def test_help_names_the_options(run_cli: Callable[..., Any]) -> None:
    result = run_cli("worker", "--help")
    out = result.out
    assert result.code == 0
    for option in ("--topology", "--metrics-port", "--grace"):
        assert option in out
    assert "MODULE:CLASS" in out
