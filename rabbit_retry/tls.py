"""TLS for the broker connections: one client ``SSLContext`` built from the CA, certificate and
key files the user names, with every unreadable file turned into one clear ``InputError`` line.

The same context serves AMQP (``amqps://``) and the management API (``https://``). It verifies
the server against the CA file (only that CA: a CA file replaces the system trust store, so a
broker signed by anyone else is refused) and checks the host name. Key passwords never appear in
any message.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TypeVar

from rabbit_retry.errors import InputError

_E = TypeVar("_E", bound=BaseException)

_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PEM_PRIVATE_KEY = b"PRIVATE KEY-----"


class _NoPassword(Exception):
    """Raised from OpenSSL's password callback: without it OpenSSL would prompt on the terminal,
    which hangs a worker that runs without one."""


def _read(option: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{option} {path}: is a directory, expected a PEM file") from None
    except PermissionError:
        raise InputError(f"{option} {path}: permission denied") from None
    except OSError as exc:
        raise InputError(f"{option} {path}: cannot be read ({exc.strerror or exc})") from None


def _ca_context(ca_file: str) -> ssl.SSLContext:
    if _PEM_CERTIFICATE not in _read("--ca-file", ca_file):
        raise InputError(f"--ca-file {ca_file}: no PEM certificate in it")
    try:
        # Given a CA file, the default context trusts it alone, not the system store too.
        return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except ssl.SSLError as exc:
        raise InputError(
            f"--ca-file {ca_file}: not a valid PEM CA certificate ({exc.reason or exc})"
        ) from None


def _load_client(
    context: ssl.SSLContext, cert_file: str, key_file: str | None, key_password: str | None
) -> None:
    cert = _read("--cert-file", cert_file)
    if _PEM_CERTIFICATE not in cert:
        raise InputError(f"--cert-file {cert_file}: no PEM certificate in it")
    key_option, key_path = ("--key-file", key_file) if key_file else ("--cert-file", cert_file)
    key = _read(key_option, key_path) if key_file else cert
    if _PEM_PRIVATE_KEY not in key:
        if key_file is None:
            raise InputError(
                f"--cert-file {cert_file}: no private key in it; give the key with --key-file"
            )
        raise InputError(f"--key-file {key_file}: no PEM private key in it")
    encrypted = b"ENCRYPTED" in key

    def password() -> str:
        if key_password is None:
            raise _NoPassword
        return key_password

    try:
        context.load_cert_chain(cert_file, key_file, password=password)
    except _NoPassword:
        raise InputError(
            f"{key_option} {key_path}: the private key is encrypted; set its password in "
            "RABBIT_RETRY_KEY_PASSWORD"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise InputError(
                f"{key_option} {key_path}: the private key does not match the certificate in "
                f"--cert-file {cert_file}"
            ) from None
        if encrypted:
            raise InputError(
                f"{key_option} {key_path}: cannot decrypt the private key (wrong password in "
                "RABBIT_RETRY_KEY_PASSWORD?)"
            ) from None
        raise InputError(
            f"--cert-file {cert_file} / {key_option} {key_path}: not a valid PEM certificate "
            f"and private key ({exc.reason or exc})"
        ) from None


def client_context(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    key_password: str | None = None,
) -> ssl.SSLContext:
    """A client context that verifies the server (against ``ca_file`` when given, else the
    system trust store), checks its host name, and presents ``cert_file`` / ``key_file``."""
    if key_file and not cert_file:
        raise InputError(f"--key-file {key_file} needs --cert-file: the certificate it belongs to")
    # Purpose.SERVER_AUTH: CERT_REQUIRED with host name checking, the safe defaults.
    if ca_file:
        context = _ca_context(ca_file)
    else:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if cert_file:
        _load_client(context, cert_file, key_file, key_password)
    return context


def cause_of(exc: BaseException, kind: type[_E] | tuple[type[_E], ...]) -> _E | None:
    """The first exception of ``kind`` behind ``exc``, however the client libraries wrapped it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # chains can loop
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def tls_cause(exc: BaseException) -> ssl.SSLError | None:
    """The ``SSLError`` behind ``exc``, if any."""
    return cause_of(exc, ssl.SSLError)


# Alerts a server sends when it refuses the client's certificate (or the lack of one).
_CLIENT_CERT_REFUSED = {
    "TLSV1_ALERT_UNKNOWN_CA": "its CA is not one the broker trusts",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the broker found it bad",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "it has expired",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "it was revoked",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "the broker does not support it",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the broker could not verify it",
    "TLSV1_ALERT_ACCESS_DENIED": "the broker denied access",
}
_NAME_MISMATCH = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


def describe_tls_error(error: ssl.SSLError) -> str:
    """What went wrong in the handshake, and which option fixes it; one line."""
    if isinstance(error, ssl.SSLCertVerificationError):
        detail = str(error.verify_message or error.reason or "unknown reason").rstrip(". ")
        if error.verify_code in _NAME_MISMATCH:
            return (
                f"the broker's certificate does not match the host name ({detail}); use a host "
                "name the certificate lists"
            )
        return (
            f"certificate verification failed: {detail} (is --ca-file the CA that signed the "
            "broker's certificate?)"
        )
    reason = str(error.reason or "")
    if reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return "the broker requires a client certificate; give --cert-file and --key-file"
    if reason in _CLIENT_CERT_REFUSED:
        return f"the broker refused the client certificate: {_CLIENT_CERT_REFUSED[reason]}"
    if reason == "WRONG_VERSION_NUMBER":
        return "the port does not speak TLS (a plain amqp:// or http:// listener?)"
    if reason == "SSLV3_ALERT_HANDSHAKE_FAILURE":
        return (
            "the broker aborted the handshake (does it require a client certificate, "
            "--cert-file / --key-file, or a TLS version this client lacks?)"
        )
    return reason.lower().replace("_", " ") if reason else str(error)
