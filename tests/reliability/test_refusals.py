"""The broker refusing us, for every verb an operator or a deployment runs first (``apply``,
``worker``, ``status``, ``parking show``): a wrong password, a vhost that does not exist, a user
without configure permission, nothing listening. One line on stderr naming what is wrong and
where, exit code 1, the password never shown.

A user without configure permission can still run what needs none: the worker only consumes
and publishes, and ``parking show`` only reads; ``apply`` is the verb that must be refused.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
from rel_support import HERE, ok_ids, spec_body
from support.amqp import Outgoing as Out
from support.amqp import publish_sync
from support.poll import wait_for
from support.process import CLI, Ran, apply, cli

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings

TOPOLOGY = """\
version: 1
queues:
  rel.orders:
    retry: {delays: [200ms], max_attempts: 2}
"""
VERBS = {
    "apply": ["apply", "{topology}"],
    "status": ["status", "{topology}"],
    "parking show": ["parking", "show", "rel.orders"],
    "worker": ["worker", "rel_consumers:Orders", "-t", "{topology}"],
}


def _with(url: str, *, user: str | None = None, password: str | None = None,
          port: int | None = None, vhost: str | None = None) -> str:
    parts = urlsplit(url)
    name = user if user is not None else parts.username or "guest"
    word = password if password is not None else parts.password or "guest"
    host = f"{parts.hostname}:{port if port is not None else parts.port}"
    path = parts.path if vhost is None else "/" + quote(vhost, safe="")
    return urlunsplit(parts._replace(netloc=f"{quote(name)}:{quote(word)}@{host}", path=path))


def _pythonpath() -> str:
    """rel_consumers, then whatever the tests run with (a work tree's package, say)."""
    return os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


def _run(settings: Settings, verb: str, topology: Path) -> Ran:
    args = [a.format(topology=topology) for a in VERBS[verb]]
    env = {"PYTHONPATH": _pythonpath(), "RR_RECORD_DIR": str(topology.parent)}
    return cli(settings, *args, timeout=60, cwd=topology.parent, env=env)


@pytest.fixture
def topology(fresh_vhost: Settings, tmp_path: Path) -> Path:
    path = tmp_path / "rel.yml"
    path.write_text(TOPOLOGY)
    apply(fresh_vhost, path)
    return path


def _api(settings: Settings) -> str:
    """The management API's address as errors print it (no credentials)."""
    with Management(settings.management_url) as api:
        return api.safe_url


def _one_line(result: Ran, *secrets_: str) -> str:
    assert result.code == 1, result
    assert result.out == "", result
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    assert "Traceback" not in result.err
    for secret in secrets_:
        assert secret not in result.err
    return lines[0]


def test_wrong_password(fresh_vhost: Settings, topology: Path) -> None:
    secret = "S3cret-" + secrets.token_hex(4)
    wrong = Settings(_with(fresh_vhost.url, password=secret),
                     _with(fresh_vhost.management_url, password=secret))
    amqp_url, api = wrong.safe_url, _api(wrong)
    assert secret not in amqp_url + api
    expected = {
        "apply": f"error: management API at {api} refused the credentials (401)",
        "status": f"error: management API at {api} refused the credentials (401)",
        "parking show": f"error: broker at {amqp_url} refused the credentials (wrong user or "
                        "password)",
        "worker": f"error: broker at {amqp_url} refused the credentials (wrong user or password)",
    }
    for verb, line in expected.items():
        assert _one_line(_run(wrong, verb, topology), secret) == line, verb


def test_missing_vhost(fresh_vhost: Settings, topology: Path) -> None:
    vhost = fresh_vhost.vhost + "-missing"
    missing = fresh_vhost.for_vhost(vhost)
    expected = {
        "apply": f"error: vhost '{vhost}' does not exist on the broker",
        "status": f"error: vhost '{vhost}' does not exist on the broker",
        "parking show": f"error: broker at {missing.safe_url} refused the vhost '{vhost}': it "
                        "does not exist or the user has no access to it",
        "worker": f"error: broker at {missing.safe_url} refused the vhost '{vhost}': it does "
                  "not exist or the user has no access to it",
    }
    for verb, line in expected.items():
        assert _one_line(_run(missing, verb, topology), ":guest@") == line, verb


def test_nothing_listening(fresh_vhost: Settings, topology: Path) -> None:
    closed = Settings(_with(fresh_vhost.url, port=1), _with(fresh_vhost.management_url, port=1))
    api = _api(closed)
    expected = {
        "apply": f"error: management API at {api} unreachable (ConnectError: [Errno 111] "
                 "Connection refused); is the rabbitmq_management plugin enabled?",
        "status": f"error: management API at {api} unreachable (ConnectError: [Errno 111] "
                  "Connection refused); is the rabbitmq_management plugin enabled?",
        "parking show": f"error: broker at {closed.safe_url} is unreachable: ",
        "worker": f"error: broker at {closed.safe_url} is unreachable: ",
    }
    for verb, line in expected.items():
        got = _one_line(_run(closed, verb, topology), ":guest@")
        assert got.startswith(line) if line.endswith(": ") else got == line, (verb, got)


@pytest.fixture
def limited_user(fresh_vhost: Settings, management: Management) -> Iterator[tuple[str, str]]:
    """A throwaway user with no tags and no configure permission on the test's vhost."""
    name = f"rr-rel-{secrets.token_hex(4)}"
    password = "Pw-" + secrets.token_hex(6)
    api = management
    response = api.request("PUT", f"/users/{quote(name, safe='')}",
                           json={"password": password, "tags": ""})
    assert response.status_code in (201, 204), response.text
    try:
        path = f"/permissions/{quote(fresh_vhost.vhost, safe='')}/{quote(name, safe='')}"
        response = api.request("PUT", path, json={"configure": "", "write": ".*", "read": ".*"})
        assert response.status_code in (201, 204), response.text
        yield name, password
    finally:
        api.request("DELETE", f"/users/{quote(name, safe='')}")


def test_user_without_configure_permission(
    fresh_vhost: Settings, topology: Path, limited_user: tuple[str, str], management: Management,
) -> None:
    name, password = limited_user
    amqp_url = _with(fresh_vhost.url, user=name, password=password)
    both = Settings(amqp_url, _with(fresh_vhost.management_url, user=name, password=password))
    admin_api = Settings(amqp_url, fresh_vhost.management_url)
    before = management.definitions(fresh_vhost.vhost)

    # apply must declare (its lock first, a queue of the vhost): refused, naming the object
    # and the user.
    changed = topology.parent / "more.yml"
    changed.write_text(TOPOLOGY + "  rel.more:\n    retry: {delays: [1s], max_attempts: 2}\n")
    line = _one_line(_run(admin_api, "apply", changed), password)
    # The lock (a queue) or the first object: whichever the user's configure pattern refuses.
    assert line.startswith(("error: taking the lock of vhost ", "error: declaring ")), line
    assert "ACCESS_REFUSED" in line, line
    assert f"refused for user '{name}'" in line
    assert management.definitions(fresh_vhost.vhost)["queues"] == before["queues"]

    # Without a management tag the HTTP API refuses the user itself, and says so.
    for verb in ("apply", "status"):
        line = _one_line(_run(both, verb, topology), password)
        assert line == (f"error: management API at {_api(both)} refused user '{name}': Not "
                        "management user (401); it needs the management or monitoring tag"), line

    # What needs no configure permission works.
    shown = _run(both, "parking show", topology)
    assert (shown.code, shown.err) == (0, ""), shown
    assert shown.out == "rel.orders.parking is empty: nothing is parked.\n"
    process = subprocess.Popen(
        [CLI, "--url", amqp_url, "worker", "rel_consumers:Orders", "-t", str(topology)],
        cwd=topology.parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": _pythonpath(),
             "RR_RECORD_DIR": str(topology.parent)},
    )
    try:
        publish_sync(fresh_vhost, [Out("ok-1", spec_body("ok-1")), Out("flaky-1",
                spec_body("flaky-1", fail=1)), Out("no-1", spec_body("no-1", permanent=True))],
                routing_key="rel.orders")
        wait_for(lambda: {"ok-1", "flaky-1"} <= ok_ids(topology.parent), "the limited worker")
        wait_for(lambda: (management.queue(fresh_vhost.vhost, "rel.orders.parking") or {})
                 .get("messages") == 1, "the permanent failure to park", within=60)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err.decode()
    assert password not in err.decode()


def test_a_management_url_left_unset_follows_the_amqp_url(
    fresh_vhost: Settings, topology: Path
) -> None:
    """Nothing listens on the AMQP port named; the management API of that host answers (the
    machine's own broker): the command must not report on that broker as if it were the one
    named."""
    nowhere = _with(fresh_vhost.url, port=5999)
    env = {"RABBIT_RETRY_URL": nowhere, "RABBIT_RETRY_MANAGEMENT_URL": ""}
    for verb in ("apply", "status"):
        args = [a.format(topology=topology) for a in VERBS[verb]]
        result = cli(None, *args, timeout=60, cwd=topology.parent, env=env)
        got = _one_line(result, ":guest@")
        assert ":5999" in got or ":15672" in got, (verb, got)
        assert "nothing to do" not in result.out


def _cluster_name(management_url: str) -> str | None:
    try:
        with Management(management_url, timeout=5) as api:
            return str(api.overview()["cluster_name"])
    except Exception:
        return None


def test_urls_of_two_different_brokers_are_refused(fresh_vhost: Settings,
                                                   topology: Path) -> None:
    ours = _cluster_name(fresh_vhost.management_url)
    # Another broker of the test matrix on this machine (3.10's, 4.0's or 4.3's own port).
    others = [f"http://guest:guest@127.0.0.1:{port}" for port in (15672, 15740, 15743)]
    other = next((u for u in others if _cluster_name(u) not in (None, ours)), None)
    if other is None:
        pytest.skip("needs a second broker: scripts/broker.sh up 4.3 (CI starts every version)")
    mixed = Settings(fresh_vhost.url, other)
    for verb in ("apply", "status"):
        result = _run(mixed, verb, topology)
        assert result.code == 2, result
        (line,) = result.err.splitlines()
        assert line.startswith("error: --url and --management-url reach different brokers: "), line
        assert f"is cluster {ours!r}" in line and ":guest@" not in line
