"""TLS: ``amqps://`` and an https management API with a CA file, a client certificate and key.

The broker side is a second RabbitMQ node started for this module (see ``tls_node``): TLS only,
client certificate required, with a CA made by the test. The main broker is not touched.
The first group of tests needs no broker: it checks the SSL context and the one-line errors
for TLS files that are missing or wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import pytest
from support.poll import eventually
from support.process import CLI
from tls_node import (
    KEY_PASSWORD,
    NodeUnavailable,
    Pki,
    TlsNode,
    make_pki,
    rabbitmq_installed,
    tls_node,
)

from rabbit_retry.broker.connect import describe_connect_error
from rabbit_retry.broker.management import Management
from rabbit_retry.errors import InputError
from rabbit_retry.settings import Settings
from rabbit_retry.tls import client_context
from rabbit_retry.worker import Delivery, Permanent, RetryConsumer, Runner

DEADLINE = 60.0


def topology_text(queue: str, exchange: str) -> str:
    return f"""\
version: 1
exchanges:
  {exchange}: {{type: topic}}
queues:
  {queue}:
    queue_type: classic
    bindings: [{{exchange: {exchange}, routing_key: "order.*"}}]
    retry: {{delays: [200ms], max_attempts: 3}}
"""


def derived(queue: str) -> list[str]:
    return [queue, f"{queue}.retry.200ms", f"{queue}.parking"]


def tls_args(settings: Settings) -> list[str]:
    """The global options of ``settings``, as a user types them."""
    args = ["--url", settings.url, "--management-url", settings.management_url]
    for option, value in (
        ("--ca-file", settings.ca_file),
        ("--cert-file", settings.cert_file),
        ("--key-file", settings.key_file),
    ):
        if value:
            args += [option, value]
    return args


def independent_context(pki: Pki) -> ssl.SSLContext:
    """Built with the standard library alone, so checks do not lean on the code under test."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return context


def no_certificate_lines(node: TlsNode) -> list[list[str]]:
    """What a user without a client certificate sees: the broker's TLS 1.3 alert, or, when the
    reset that follows the alert wins the race (it does under load), the hint without it."""
    where = f"amqps://guest:***@localhost:{node.amqps_port}/"
    return [
        [
            f"error: TLS handshake with {where} failed: the broker requires a client "
            "certificate; give --cert-file and --key-file"
        ],
        [
            f"error: broker at {where} closed the connection right after the TLS handshake: "
            "does it require a client certificate? give --cert-file and --key-file"
        ],
    ]


# --- the SSL context and bad TLS files (no broker) ----------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_the_context_verifies_the_server_against_the_ca_file_alone(pki: Pki) -> None:
    context = client_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    # Only our CA: a CA file replaces the system trust store instead of adding to it.
    subjects = [dict(rdn[0] for rdn in ca["subject"]) for ca in context.get_ca_certs()]
    assert subjects == [{"commonName": "rabbit-retry test CA"}]


def test_settings_read_the_tls_files_from_the_environment(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RABBIT_RETRY_CA_FILE", str(pki.ca))
    monkeypatch.setenv("RABBIT_RETRY_CERT_FILE", str(pki.client_cert))
    monkeypatch.setenv("RABBIT_RETRY_KEY_FILE", str(pki.client_key_encrypted))
    monkeypatch.setenv("RABBIT_RETRY_KEY_PASSWORD", KEY_PASSWORD)
    settings = Settings.from_env("amqps://guest:guest@localhost:5671/", "http://localhost:15672")
    assert settings.ca_file == str(pki.ca)
    assert settings.cert_file == str(pki.client_cert)
    assert settings.key_password == KEY_PASSWORD
    assert KEY_PASSWORD not in repr(settings)
    assert settings.amqp_tls() is not None
    assert settings.management_tls() is None  # http://: nothing to verify
    # Another vhost of the same broker keeps the TLS files.
    assert settings.for_vhost("other").cert_file == str(pki.client_cert)
    # Without TLS files, amqps:// is left to the client library (and URL options) as before.
    assert Settings(url="amqps://localhost/").amqp_tls() is None


def _bad_file_cases(pki: Pki, tmp: Path) -> list[tuple[dict[str, str | None], str]]:
    junk = tmp / "junk.pem"
    junk.write_text("not a certificate\n")
    enc = str(pki.client_key_encrypted)
    ca, cert, key = str(pki.ca), str(pki.client_cert), str(pki.client_key)
    other_key = str(pki.other_ca.with_suffix(".key"))
    return [
        ({"ca_file": "/nonexistent/ca.pem"}, "--ca-file /nonexistent/ca.pem: no such file"),
        ({"ca_file": str(tmp)}, f"--ca-file {tmp}: is a directory, expected a PEM file"),
        ({"ca_file": str(junk)}, f"--ca-file {junk}: no PEM certificate in it"),
        (
            {"ca_file": ca, "cert_file": key, "key_file": key},
            f"--cert-file {key}: no PEM certificate in it",
        ),
        (
            {"ca_file": ca, "cert_file": cert, "key_file": "/nonexistent/client.key"},
            "--key-file /nonexistent/client.key: no such file",
        ),
        (
            {"ca_file": ca, "cert_file": cert, "key_file": str(junk)},
            f"--key-file {junk}: no PEM private key in it",
        ),
        (
            {"ca_file": ca, "key_file": key},
            f"--key-file {key} needs --cert-file: the certificate it belongs to",
        ),
        (
            {"ca_file": ca, "cert_file": cert},
            f"--cert-file {cert}: no private key in it; give the key with --key-file",
        ),
        (
            {"ca_file": ca, "cert_file": cert, "key_file": other_key},
            f"--key-file {other_key}: the private key does not match the certificate in "
            f"--cert-file {cert}",
        ),
        (
            {"ca_file": ca, "cert_file": cert, "key_file": enc},
            f"--key-file {enc}: the private key is encrypted; set its password in "
            "RABBIT_RETRY_KEY_PASSWORD",
        ),
        (
            {"ca_file": ca, "cert_file": cert, "key_file": enc, "key_password": "wrong-pw"},
            f"--key-file {enc}: cannot decrypt the private key (wrong password in "
            "RABBIT_RETRY_KEY_PASSWORD?)",
        ),
    ]


def test_each_bad_tls_file_is_one_clear_input_error(pki: Pki, tmp_path: Path) -> None:
    for files, message in _bad_file_cases(pki, tmp_path):
        with pytest.raises(InputError) as caught:
            client_context(**files)
        assert str(caught.value) == message, files
        assert "wrong-pw" not in str(caught.value)


def test_an_encrypted_key_loads_with_its_password(pki: Pki) -> None:
    enc = str(pki.client_key_encrypted)
    context = client_context(str(pki.ca), str(pki.client_cert), enc, KEY_PASSWORD)
    assert context.verify_mode == ssl.CERT_REQUIRED


def test_bad_tls_options_on_the_command_line_exit_2_before_touching_a_broker(
    pki: Pki, run_cli: Callable[..., Any]
) -> None:
    url = ["--url", "amqps://guest:secret-pw@localhost:1/"]
    cases = [
        (
            ["--ca-file", "/nonexistent/ca.pem"],
            "error: --ca-file /nonexistent/ca.pem: no such file",
        ),
        (
            ["--ca-file", str(pki.ca), "--key-file", str(pki.client_key)],
            f"error: --key-file {pki.client_key} needs --cert-file: the certificate it belongs to",
        ),
    ]
    for args, line in cases:
        result = run_cli(*url, *args, "status", "topology.yml")
        assert (result.code, result.out, result.err.splitlines()) == (2, "", [line])
    # TLS files with nothing that would use them: a mistake, not a silent plain connection.
    result = run_cli(
        "--url",
        "amqp://guest:secret-pw@localhost:1/",
        "--ca-file",
        str(pki.ca),
        "status",
        "topology.yml",
    )
    assert result.code == 2
    assert result.err.splitlines() == [
        "error: --ca-file / --cert-file / --key-file given, but neither --url "
        "(amqp://guest:***@localhost:1/) is amqps:// nor --management-url "
        "(http://guest:***@localhost:15672) is https://"
    ]


def _wrapped(error: BaseException) -> BaseException:
    """``error`` as aiormq raises it: inside an ``AMQPConnectionError``."""
    try:
        try:
            raise error
        except OSError as exc:
            raise aiormq.exceptions.AMQPConnectionError(f"Server connection: {exc!r}") from exc
    except aiormq.exceptions.AMQPConnectionError as outer:
        return outer


def test_a_reset_right_after_the_handshake_points_at_the_client_certificate(pki: Pki) -> None:
    url = "amqps://guest:secret-pw@localhost:5671/"
    reset = _wrapped(ConnectionResetError(104, "Connection reset by peer"))
    prefix = "broker at amqps://guest:***@localhost:5671/ closed the connection right after "
    assert describe_connect_error(reset, Settings(url=url, ca_file=str(pki.ca))) == (
        prefix + "the TLS handshake: does it require a client certificate? give --cert-file and "
        "--key-file"
    )
    with_cert = Settings(url=url, cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    assert describe_connect_error(reset, with_cert) == (
        prefix + "the TLS handshake: did it refuse the client certificate of --cert-file?"
    )
    # Not every failure on amqps:// is about TLS: a closed port is just unreachable.
    refused = _wrapped(ConnectionRefusedError(111, "Connection refused"))
    assert describe_connect_error(refused, Settings(url=url)) == (
        "broker at amqps://guest:***@localhost:5671/ is unreachable: connection refused"
    )


# --- against a TLS-only broker node ---------------------------------------------------------------


@pytest.fixture(scope="module")
def node() -> Iterator[TlsNode]:
    if not rabbitmq_installed():
        pytest.skip("rabbitmq-server / rabbitmqctl are not installed: no TLS node to test against")
    try:
        with tls_node() as started:
            yield started
    except NodeUnavailable as exc:
        pytest.fail(f"could not start the TLS RabbitMQ node: {exc}")


async def _passive_declare(node: TlsNode, names: list[str]) -> dict[str, int]:
    """Message counts of ``names`` over AMQPS (fails if one does not exist)."""
    connection = await aio_pika.connect(node.url(), ssl_context=independent_context(node.pki))
    async with connection:
        counts = {}
        for name in names:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, passive=True)
            counts[name] = queue.declaration_result.message_count or 0
            await channel.close()
        return counts


def _management(node: TlsNode) -> Management:
    return Management(node.management_url, tls=independent_context(node.pki))


def _queue_names(node: TlsNode) -> set[str]:
    with _management(node) as api:
        return {q["name"] for q in api.queues("/")}


def test_apply_over_amqps_creates_the_queues(
    node: TlsNode, run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    file = tmp_path / "tls-apply.yml"
    file.write_text(topology_text("tls.apply", "tls-apply"))
    result = run_cli(*tls_args(node.settings()), "apply", str(file))
    assert (result.code, result.err) == (0, "")
    assert result.out == "created 2 exchanges, 3 queues and 3 bindings in vhost '/'\n"
    assert asyncio.run(_passive_declare(node, derived("tls.apply"))) == dict.fromkeys(
        derived("tls.apply"), 0
    )
    with _management(node) as api:
        main = api.queue("/", "tls.apply")
    assert main is not None
    assert main["arguments"]["x-dead-letter-exchange"] == "tls.apply.retry"
    # A second run over TLS changes nothing.
    again = run_cli(*tls_args(node.settings()), "apply", str(file))
    assert again.code == 0
    assert "nothing to do" in again.out


def test_without_a_client_certificate_the_broker_refuses_in_one_line(
    node: TlsNode, run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    file = tmp_path / "tls-nocert.yml"
    file.write_text(topology_text("tls.nocert", "tls-nocert"))
    settings = node.settings(client_cert=False)
    # The management API does not ask for a certificate; the AMQPS listener does.
    result = run_cli(*tls_args(settings), "apply", str(file))
    assert (result.code, result.out) == (1, "")
    assert result.err.splitlines() in no_certificate_lines(node)
    assert not {"tls.nocert", "tls.nocert.parking"} & _queue_names(node)


def test_a_wrong_ca_fails_verification_in_one_line(
    node: TlsNode, run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    wrong = replace(node.settings(), ca_file=str(node.pki.other_ca))
    verification = (
        "certificate verification failed: self-signed certificate in certificate chain (is "
        "--ca-file the CA that signed the broker's certificate?)"
    )
    file = tmp_path / "tls-wrongca.yml"
    file.write_text(topology_text("tls.wrongca", "tls-wrongca"))
    # apply reads the live state first: the https management API is refused.
    result = run_cli(*tls_args(wrong), "apply", str(file))
    assert (result.code, result.out) == (1, "")
    assert result.err.splitlines() == [
        f"error: TLS handshake with management API at https://localhost:{node.management_port} "
        f"failed: {verification}"
    ]
    # parking opens AMQPS first: refused the same way.
    result = run_cli(*tls_args(wrong), "parking", "show", "tls.wrongca")
    assert (result.code, result.out) == (1, "")
    assert result.err.splitlines() == [
        f"error: TLS handshake with amqps://guest:***@localhost:{node.amqps_port}/ failed: "
        f"{verification}"
    ]
    assert "tls.wrongca" not in _queue_names(node)


def test_a_host_name_the_certificate_does_not_list_is_refused(
    node: TlsNode, run_cli: Callable[..., Any]
) -> None:
    # The node also listens on 127.0.0.2, which its certificate does not name.
    result = run_cli(*tls_args(node.settings(host="127.0.0.2")), "parking", "show", "anything")
    assert (result.code, result.out) == (1, "")
    assert result.err.splitlines() == [
        f"error: TLS handshake with amqps://guest:***@127.0.0.2:{node.amqps_port}/ failed: the "
        "broker's certificate does not match the host name (IP address mismatch, certificate is "
        "not valid for '127.0.0.2'); use a host name the certificate lists"
    ]


def test_an_encrypted_key_with_its_password_from_the_environment(
    node: TlsNode, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = replace(node.settings(), key_file=str(node.pki.client_key_encrypted))
    monkeypatch.setenv("RABBIT_RETRY_KEY_PASSWORD", KEY_PASSWORD)
    result = run_cli(*tls_args(settings), "parking", "show", "no-such-queue")
    # Past the handshake: the broker answered that the queue does not exist.
    assert (result.code, result.out) == (2, "")
    assert result.err.splitlines() == [
        "error: queue 'no-such-queue.parking' does not exist in vhost '/': is 'no-such-queue' a "
        "queue of a topology applied to this vhost?"
    ]


class _Orders(RetryConsumer):
    """ok: succeeds; flaky: fails its first attempt; bad: Permanent."""

    queue = "tls.worker"
    prefetch = 5
    handler_timeout = 10.0

    def __init__(self) -> None:
        self.succeeded: dict[str, int] = {}

    async def handle(self, delivery: Delivery) -> None:
        kind = delivery.body.decode()
        if kind == "bad":
            raise Permanent("refused over TLS")
        if kind == "flaky" and delivery.attempt == 1:
            raise RuntimeError("transient")
        self.succeeded[delivery.message_id or ""] = delivery.attempt


async def _run_worker(node: TlsNode, file: Path) -> tuple[dict[str, int], list[dict[str, Any]]]:
    consumer = _Orders()
    runner = Runner([consumer], topology=file, settings=node.settings(), grace=5.0)
    task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(runner.ready.wait(), DEADLINE)
        with _management(node) as api:
            await eventually(
                lambda: any(
                    c.get("user_provided_name") == "rabbit-retry worker" for c in api.connections()
                ),
                within=DEADLINE,
                interval=0.1,
                what="the worker's connection shows in the management API",
            )
            connections = [
                c for c in api.connections() if c.get("user_provided_name") == "rabbit-retry worker"
            ]
        connection = await aio_pika.connect(node.url(), ssl_context=independent_context(node.pki))
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("tls-worker")
            for kind in ("ok", "flaky", "bad"):
                message = aio_pika.Message(kind.encode(), message_id=kind, delivery_mode=2)
                await exchange.publish(message, routing_key="order.created")

        async def parked() -> int:
            return (await _passive_declare(node, ["tls.worker.parking"]))["tls.worker.parking"]

        async def settled() -> bool:
            return len(consumer.succeeded) >= 2 and await parked() >= 1

        await eventually(settled, within=DEADLINE, interval=0.1,
                         what="the worker over TLS to handle two messages and park one")
    finally:
        runner.stop()
        await asyncio.wait_for(task, DEADLINE)
    return consumer.succeeded, connections


def test_a_worker_consumes_retries_and_parks_over_tls(
    node: TlsNode, run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    file = tmp_path / "tls-worker.yml"
    file.write_text(topology_text("tls.worker", "tls-worker"))
    assert run_cli(*tls_args(node.settings()), "apply", str(file)).code == 0

    succeeded, connections = asyncio.run(_run_worker(node, file))

    assert succeeded == {"ok": 1, "flaky": 2}  # flaky came back through the 200ms tier
    # The worker's connection is TLS and presented our client certificate.
    assert [(c["ssl"], c["peer_cert_subject"]) for c in connections] == [
        (True, "CN=rabbit-retry test client")
    ]
    counts = asyncio.run(_passive_declare(node, derived("tls.worker")))
    assert counts == {"tls.worker": 0, "tls.worker.retry.200ms": 0, "tls.worker.parking": 1}
    # The operator reads it back over TLS too.
    result = run_cli(*tls_args(node.settings()), "parking", "show", "tls.worker", "--json")
    assert result.code == 0, result.err
    shown = json.loads(result.out)
    assert [(m["message_id"], m["reason"], m["exception_message"]) for m in shown["messages"]] == [
        ("bad", "permanent", "refused over TLS")
    ]


def test_the_worker_command_reads_tls_files_from_the_environment(
    node: TlsNode, tmp_path: Path
) -> None:
    """``rabbit-retry worker`` as a process, configured by environment variables only: with the
    CA but no client certificate it stops at once with one line and exit code 1."""
    (tmp_path / "topology.yml").write_text(topology_text("tls.envworker", "tls-envworker"))
    (tmp_path / "app.py").write_text(
        "from rabbit_retry import RetryConsumer\n\n\n"
        "class App(RetryConsumer):\n"
        "    queue = 'tls.envworker'\n\n"
        "    async def handle(self, delivery):\n"
        "        pass\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RABBIT_RETRY_")}
    env |= {
        "RABBIT_RETRY_URL": node.url(),
        "RABBIT_RETRY_MANAGEMENT_URL": node.management_url,
        "RABBIT_RETRY_CA_FILE": str(node.pki.ca),
    }
    done = subprocess.run(
        [CLI, "worker", "app:App", "-t", "topology.yml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() in no_certificate_lines(node)
