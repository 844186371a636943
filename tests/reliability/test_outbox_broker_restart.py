"""The broker application stopped and started under a publishing relay: every committed event
arrives, in order per key, and the relay says once that it lost the broker and once that it is
back. It stops the shared broker for a few seconds (``finally`` brings it back): the lead's full
runs only, like the worker's broker-restart test in test_worker_faults.py."""

from __future__ import annotations

from pathlib import Path

from support.amqp import drain_sync
from support.broker import restart_app
from support.outbox import RelayProcess, Writer, events_topology, out_of_order, published
from support.poll import wait_for

from rabbit_retry.broker.management import Management
from rabbit_retry.outbox import Outbox
from rabbit_retry.settings import Settings


def test_the_broker_restarted_under_a_publishing_relay_loses_nothing(
    fresh_vhost: Settings, tmp_path: Path, management: Management,
) -> None:
    topology = events_topology(fresh_vhost, tmp_path, "quorum")
    url = f"sqlite:///{tmp_path / 'app.db'}"
    relay = RelayProcess(fresh_vhost, topology, url, tmp_path / "relay.log")
    # The application writes until told to stop: events are committed while the broker is down
    # and after it is back, whatever the relay had caught up with when the broker stopped (a
    # fixed 20,000 were all published before the broker went down on a quiet machine: the
    # relay then stopped before it had reconnected).
    writer = Writer(url, Outbox(topology), 500_000, exchange="rel", routing_key="event.new",
                    pause=0.01)
    try:
        relay.start()
        writer.start()
        wait_for(lambda: published(url) >= 3_000, "3,000 published", interval=0.05)
        restart_app(management)
        wait_for(lambda: "broker back after" in relay.log(), "the relay back on the broker",
                 within=120, interval=0.2)
        back = writer.written
        wait_for(lambda: writer.written >= back + 1_000, "1,000 more events written")
        writer.stop()
        writer.join()
        committed = len(writer.committed)
        wait_for(lambda: published(url) == committed, "every committed event published",
                 within=600, interval=0.5)
        assert relay.stop() == 0
    except AssertionError as exc:  # what the relay said, for the failure's reader
        raise AssertionError(f"{exc}\nthe relay's log:\n{relay.log()[-3000:]}") from None
    finally:
        writer.stop()  # a failure above leaves it writing otherwise
        relay.ensure_dead()
    log = relay.log()
    assert log.count("lost the broker") == 1 and log.count("broker back after") == 1, log[-3000:]
    assert "Traceback" not in log
    copies = drain_sync(fresh_vhost, "rel.events")
    assert writer.committed <= {c.message_id for c in copies}
    assert out_of_order([c.body for c in copies]) == []
    print(f"[reliability] broker restarted under the relay: {committed} committed, "
          f"{len(copies)} delivered")
