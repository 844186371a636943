"""The broker under test, beyond its URLs (test-only): its version, and its own rabbitmqctl.

``scripts/broker.sh env VERSION`` exports ``RABBIT_RETRY_TEST_CTL`` (a command that runs the
rabbitmqctl of that broker's version, aimed at its node) and ``RABBIT_RETRY_TEST_NODE``: the
machine's rabbitmqctl cannot reach a node of another version (Erlang cookie and distribution).
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import time

from rabbit_retry.broker.management import Management


def ctl(management: Management, *args: str, timeout: float = 180.0) -> str:
    """``rabbitmqctl ARGS`` against the broker under test; its output, or AssertionError."""
    prefix = shlex.split(os.environ.get("RABBIT_RETRY_TEST_CTL", "rabbitmqctl"))
    hint = ""
    if prefix == ["rabbitmqctl"]:
        prefix += ["-n", _node(management)]
        hint = ("; a broker of another version than the machine's needs RABBIT_RETRY_TEST_CTL "
                "(eval \"$(scripts/broker.sh env VERSION)\")")
    done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (
        f"{shlex.join([*prefix, *args])}: {(done.stderr or done.stdout).strip()}{hint}"
    )
    return done.stdout


def restart_app(management: Management) -> None:
    """Stop the broker application and start it again (a test marked ``alone``): it comes back
    whatever happens while it is down."""
    try:
        ctl(management, "stop_app")  # itself takes several seconds: it closes every queue cleanly
        time.sleep(1)
    finally:
        ctl(management, "start_app")
        ctl(management, "await_startup")


def enable_plugin(management: Management, exchange_type: str, plugin: str) -> None:
    """Enable ``plugin`` on the broker under test as a user would (``rabbitmq-plugins enable``:
    no restart), unless the broker already offers ``exchange_type``."""
    offered = {t.get("name") for t in management.overview().get("exchange_types") or []}
    if exchange_type in offered:
        return
    version = os.environ.get("RABBIT_RETRY_TEST_BROKER")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = ([os.path.join(root, "scripts", "broker.sh"), "plugins", version] if version
            else ["rabbitmq-plugins"])
    done = subprocess.run([*argv, "enable", plugin], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{shlex.join(argv)} enable {plugin}: {done.stderr.strip()}"


@functools.cache
def _node(management: Management) -> str:
    """The node's name, looked up once: a test that runs ``stop_app`` must still be able to run
    ``start_app``, when the management API that names the node is down with the app."""
    return os.environ.get("RABBIT_RETRY_TEST_NODE") or str(management.overview()["node"])


def version(management: Management) -> tuple[int, int]:
    """(major, minor) of the broker under test."""
    major, minor = str(management.overview()["rabbitmq_version"]).split(".")[:2]
    return int(major), int(minor)
