"""The ``rabbit-retry parking`` command as a separate process: killed in the middle of a replay
(nothing may be lost), and confirming on a real terminal (a pseudo-terminal)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from support.amqp import depth_sync, drain_sync, total_depth
from support.parked import Parked, look, park
from support.poll import wait_for
from support.process import CLI
from support.provision import provision

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

TOPOLOGY = """
version: 1
queues:
  orders:
    retry: {delays: [1h], max_attempts: 3}
"""
DEADLINE_S = 60.0


def test_a_replay_killed_midway_loses_nothing(fresh_vhost: Settings, capsys: object) -> None:
    total = 60
    ids = [f"k{i:02d}" for i in range(total)]
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    asyncio.run(park(fresh_vhost, "orders", [Parked(i.encode(), message_id=i) for i in ids]))

    process = subprocess.Popen(
        [CLI, "--url", fresh_vhost.url, "--management-url", fresh_vhost.management_url,
         "parking", "replay", "orders", "--yes", "--rate", "20"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: depth_sync(fresh_vhost, "orders") >= 5, "the replay to start")
    finally:
        process.send_signal(signal.SIGKILL)
        out, _ = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert b"replayed" not in out, "the replay finished before it was killed; raise the count"

    # The broker requeues what the dead process held once it notices the closed socket.
    def settled() -> bool:
        return total_depth(fresh_vhost, ["orders", "orders.parking"]) >= total

    wait_for(settled, "the killed process's messages to be requeued")
    replayed = [m.message_id for m in drain_sync(fresh_vhost, "orders")]
    parked = [m.message_id for m in drain_sync(fresh_vhost, "orders.parking")]
    duplicates = len(replayed) + len(parked) - total
    print(f"killed after {len(replayed)} replayed; {len(parked)} still parked; "
          f"{duplicates} duplicate(s)")
    assert set(replayed) | set(parked) == set(ids)  # nothing lost
    assert 0 <= duplicates <= 1  # at most the one in flight
    assert replayed == ids[: len(replayed)]  # replayed from the head, in order
    assert parked == ids[total - len(parked) :]  # what is left is the tail, in order


def _run_on_a_terminal(settings: Settings, args: list[str], answer: bytes) -> tuple[int, str]:
    """Runs the command with a pseudo-terminal as stdin and types ``answer`` at the prompt."""
    import pty

    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [CLI, "--url", settings.url, "--management-url", settings.management_url, *args],
        stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    os.close(secondary)
    try:
        os.write(primary, answer)
        out, _ = process.communicate(timeout=DEADLINE_S)
    finally:
        os.close(primary)
    return process.returncode, out.decode()


def test_on_a_terminal_replay_asks_with_the_count_and_no_means_nothing(
    fresh_vhost: Settings, management: Management
) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    asyncio.run(park(fresh_vhost, "orders", [
        Parked(b"a", "KeyError", message_id="a"),
        Parked(b"b", "ValueError", message_id="b"),
        Parked(b"c", "KeyError", message_id="c"),
    ]))
    args = ["parking", "replay", "orders", "--where", "exception-type=KeyError"]
    code, out = _run_on_a_terminal(fresh_vhost, args, b"n\n")
    assert code == 2
    assert out == ("Replay 2 of 3 parked messages in 'orders.parking' to 'orders' "
                   "(exception-type=KeyError)? [y/N]: aborted\n")
    assert [s.properties["message_id"] for s in look(management, fresh_vhost, "orders.parking")] \
        == ["a", "b", "c"]

    code, out = _run_on_a_terminal(fresh_vhost, args, b"y\n")
    assert code == 0, out
    assert out.endswith("replayed 2 of 3 parked messages from 'orders.parking' to 'orders' "
                        "(exception-type=KeyError); 1 left parked\n")
    assert [m.message_id for m in drain_sync(fresh_vhost, "orders")] == ["a", "c"]
    assert depth_sync(fresh_vhost, "orders.parking") == 1


def test_on_a_terminal_purge_says_when_nothing_matches(fresh_vhost: Settings) -> None:
    asyncio.run(provision(fresh_vhost, TOPOLOGY))
    asyncio.run(park(fresh_vhost, "orders", [Parked(b"a", message_id="a")]))
    code, out = _run_on_a_terminal(
        fresh_vhost, ["parking", "purge", "orders", "--older-than", "1d"], b"")
    assert code == 0
    assert out == ("nothing to purge: none of the 1 parked message in 'orders.parking' matches "
                   "parked more than 1d ago\n")
    assert depth_sync(fresh_vhost, "orders.parking") == 1
