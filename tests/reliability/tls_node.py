"""A throwaway second RabbitMQ node that speaks only TLS, and the test PKI it needs.

The node runs beside the main broker (which stays exactly as it is) with its own name, ports,
data, log and config directory under a temporary directory: AMQPS on 127.0.0.1 and 127.0.0.2
(the server certificate names only localhost and 127.0.0.1, so 127.0.0.2 is a host name
mismatch), no plain AMQP listener, and the management API over https. The AMQPS listener
requires a client certificate (``verify_peer`` + ``fail_if_no_peer_cert``).

Certificates are made with the ``openssl`` command: a CA, a server certificate for localhost, a
client certificate (its key also encrypted), and a second CA that signed nothing of the node's.

The node always comes from the machine's own rabbitmq-server package (3.10 here), whichever
broker the rest of the run tests (RABBIT_RETRY_TEST_URL and RABBIT_RETRY_TEST_CTL may name a
4.x node in a chroot): these tests check our TLS client (contexts, certificates, one-line
errors), which does not depend on the broker's version, and only the machine's package can
start a throwaway node here (its rabbitmqctl reaches it with the machine's Erlang cookie). So
nothing here reads the broker under test: not its URL, its node nor its rabbitmqctl.
"""

from __future__ import annotations

import os
import pwd
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from rabbit_retry.settings import Settings

KEY_PASSWORD = "s3cret-key-pw"  # of Pki.client_key_encrypted
START_DEADLINE = 120.0  # seconds; a node boots in 5-20 s, slower on a loaded 2-core machine
STOP_DEADLINE = 60.0

_CA_EXTENSIONS = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""

_LEAF_EXTENSIONS = """\
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = {usage}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
{san}
"""


class NodeUnavailable(Exception):
    """The TLS node could not be started; the message says why (with the node's log tail)."""


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_key_encrypted: Path  # the same key, encrypted with KEY_PASSWORD
    other_ca: Path


def _openssl(command: str, cwd: Path) -> None:
    done = subprocess.run(
        ["openssl", *shlex.split(command)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise NodeUnavailable(f"openssl {command} failed: {done.stderr.strip()}")


def _new_key(name: str, cwd: Path) -> None:
    _openssl(f"genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out {name}", cwd)


def _new_ca(stem: str, subject: str, cwd: Path) -> None:
    (cwd / "ca.cnf").write_text(_CA_EXTENSIONS)
    _new_key(f"{stem}.key", cwd)
    _openssl(
        f"req -x509 -new -key {stem}.key -subj '{subject}' -days 2 -config ca.cnf "
        f"-extensions ca -out {stem}.pem",
        cwd,
    )


def _new_leaf(stem: str, subject: str, usage: str, san: str, cwd: Path) -> None:
    _new_key(f"{stem}.key", cwd)
    _openssl(f"req -new -key {stem}.key -subj '{subject}' -out {stem}.csr", cwd)
    (cwd / f"{stem}.ext").write_text(_LEAF_EXTENSIONS.format(usage=usage, san=san))
    _openssl(
        f"x509 -req -in {stem}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
        f"-extfile {stem}.ext -out {stem}.pem",
        cwd,
    )


def make_pki(directory: Path) -> Pki:
    """A CA, a server certificate for localhost / 127.0.0.1, a client certificate, and an
    unrelated CA, all PEM (EC P-256: quick to make)."""
    directory.mkdir(parents=True, exist_ok=True)
    _new_ca("ca", "/CN=rabbit-retry test CA", directory)
    _new_leaf(
        "server",
        "/CN=localhost",
        "serverAuth",
        "subjectAltName = DNS:localhost,IP:127.0.0.1",
        directory,
    )
    _new_leaf("client", "/CN=rabbit-retry test client", "clientAuth", "", directory)
    _openssl(
        f"pkey -in client.key -aes256 -passout pass:{KEY_PASSWORD} -out client-enc.key", directory
    )
    other = directory / "other"
    other.mkdir()
    _new_ca("ca", "/CN=some other CA", other)
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        client_key_encrypted=directory / "client-enc.key",
        other_ca=other / "ca.pem",
    )


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now, for the node to listen on a few seconds later. Not
    ones the system picks for port 0: those come from its ephemeral range, which every outgoing
    connection and every desk the tests start (``--listen HOST:0``) draw from meanwhile, so
    another socket could take one first. Between the tests' brokers' fixed ports (up to 25763,
    scripts/broker.sh and cluster.sh) and that range only listeners that name their port live."""
    low = _ephemeral_low()
    span = range(26_000, low if low > 27_000 else 32_768)
    ports: list[int] = []
    while len(ports) < count:
        port = random.choice(span)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def rabbitmq_installed() -> bool:
    return shutil.which("rabbitmq-server") is not None and shutil.which("rabbitmqctl") is not None


@dataclass(frozen=True)
class TlsNode:
    name: str
    amqps_port: int
    management_port: int
    pki: Pki

    def url(self, host: str = "localhost", vhost: str = "") -> str:
        return f"amqps://guest:guest@{host}:{self.amqps_port}/{vhost}"

    @property
    def management_url(self) -> str:
        return f"https://guest:guest@localhost:{self.management_port}"

    def settings(self, *, host: str = "localhost", client_cert: bool = True) -> Settings:
        """Settings that reach this node over TLS: the right CA, and the client certificate
        unless ``client_cert`` is False."""
        return Settings(
            url=self.url(host),
            management_url=self.management_url,
            ca_file=str(self.pki.ca),
            cert_file=str(self.pki.client_cert) if client_cert else None,
            key_file=str(self.pki.client_key) if client_cert else None,
        )


def _config(pki: Pki, amqps_port: int, management_port: int) -> str:
    tls = "\n".join(
        f"{prefix}.{key} = {path}"
        for prefix in ("ssl_options", "management.ssl")
        for key, path in (
            ("cacertfile", pki.ca),
            ("certfile", pki.server_cert),
            ("keyfile", pki.server_key),
        )
    )
    return f"""\
listeners.tcp = none
listeners.ssl.loopback = 127.0.0.1:{amqps_port}
listeners.ssl.mismatch = 127.0.0.2:{amqps_port}
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
management.ssl.ip = 127.0.0.1
management.ssl.port = {management_port}
{tls}
"""


def _ctl(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # The machine's rabbitmqctl, never RABBIT_RETRY_TEST_CTL: this node is the machine's package.
    return subprocess.run(
        ["rabbitmqctl", "-n", name, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _hand_to_rabbitmq(directory: Path) -> None:
    """Started as root, the rabbitmq-server wrapper runs the node as the rabbitmq user (so it
    shares the main broker's Erlang cookie and rabbitmqctl reaches it): it needs the files."""
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam("rabbitmq")
    except KeyError:
        return
    for path in [directory, *directory.rglob("*")]:
        os.chown(path, user.pw_uid, user.pw_gid)


def _wait_started(name: str, process: subprocess.Popen[bytes], output: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NodeUnavailable(
                f"rabbitmq-server for {name} exited with code {process.returncode}:\n"
                f"{_tail(output)}"
            )
        left = max(1.0, deadline - time.monotonic())
        try:
            done = _ctl(name, "await_startup", "--timeout", "10", timeout=min(30.0, left + 5))
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0:
            return
        last = (done.stderr or done.stdout).strip()
        time.sleep(1.0)
    raise NodeUnavailable(
        f"node {name} did not start within {START_DEADLINE:.0f}s; rabbitmqctl said: {last}\n"
        f"{_tail(output)}"
    )


def _stop(name: str, process: subprocess.Popen[bytes], pid_file: Path) -> None:
    with suppress(subprocess.TimeoutExpired):
        _ctl(name, "stop", timeout=STOP_DEADLINE)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_DEADLINE)
        return
    # The wrapper (su) started the node in a session of its own: kill exactly the node's pid.
    with suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
    with suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@contextmanager
def tls_node() -> Iterator[TlsNode]:
    """Makes the PKI, starts the node, yields it; stops it and deletes its files at the end."""
    base = Path(tempfile.mkdtemp(prefix="rr-tls-"))
    try:
        pki = make_pki(base / "pki")
        name = f"rr-tls-{secrets.token_hex(4)}@localhost"
        amqps_port, management_port, dist_port = free_ports(3)
        (base / "rabbitmq.conf").write_text(_config(pki, amqps_port, management_port))
        (base / "enabled_plugins").write_text("[rabbitmq_management].\n")
        # Our own env file, so /etc/rabbitmq/rabbitmq-env.conf (the main node's) is not read.
        (base / "rabbitmq-env.conf").write_text("ERL_EPMD_ADDRESS=127.0.0.1\n")
        for sub in ("mnesia", "log"):
            (base / sub).mkdir()
        _hand_to_rabbitmq(base)
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": name,
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_PID_FILE": str(base / "node.pid"),
            "RABBITMQ_DIST_PORT": str(dist_port),
        }
        output = base / "server.out"
        with output.open("wb") as out:
            process = subprocess.Popen(
                ["rabbitmq-server"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait_started(name, process, output)
            yield TlsNode(name, amqps_port, management_port, pki)
        finally:
            _stop(name, process, base / "node.pid")
    finally:
        shutil.rmtree(base, ignore_errors=True)
