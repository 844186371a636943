"""What the vhost's lock says about its holder, without a broker (the lock itself, its waits
and a killed holder: tests/integration/test_provision_ci.py)."""

from __future__ import annotations

import os
import socket

from rabbit_retry.broker.lock import describe_holder, holder_arguments


def test_the_holder_is_named_by_verb_file_host_pid_and_since() -> None:
    arguments = holder_arguments("migrate", "topologies/orders.yml")
    assert arguments["rabbit-retry-pid"] == os.getpid()
    assert arguments["rabbit-retry-host"] == socket.gethostname()
    line = describe_holder(arguments)
    assert line.startswith(f"migrate of topologies/orders.yml on host {socket.gethostname()}, "
                           f"pid {os.getpid()}, since 20")
    assert line.endswith("Z")


def test_a_lock_without_a_holder_says_so() -> None:
    assert describe_holder(None) == "another run (it is gone, or did not say who it is)"
    assert describe_holder({"x-queue-type": "classic"}) == (
        "a queue named rabbit-retry.lock that rabbit-retry did not make")
    assert describe_holder({"rabbit-retry-pid": 7}) == "a run of ? on host ?, pid 7, since ?"
