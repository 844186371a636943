"""Connection settings: AMQP and management URLs (one node, or the nodes of one cluster), the
vhost they name, TLS files, and password masking."""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from rabbit_retry.errors import InputError

DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
DEFAULT_MANAGEMENT_URL = "http://guest:guest@localhost:15672"
URL_ENV = "RABBIT_RETRY_URL"
MANAGEMENT_URL_ENV = "RABBIT_RETRY_MANAGEMENT_URL"
CA_FILE_ENV = "RABBIT_RETRY_CA_FILE"
CERT_FILE_ENV = "RABBIT_RETRY_CERT_FILE"
KEY_FILE_ENV = "RABBIT_RETRY_KEY_FILE"
KEY_PASSWORD_ENV = "RABBIT_RETRY_KEY_PASSWORD"

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>[^@/\s]*)@")


# libpq and redis-py also take the password as a query parameter (``?password=...``).
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&]password=)[^&\s]*", re.IGNORECASE)


def mask(text: str) -> str:
    """Replace the password of every URL in ``text`` with ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _QUERY_PASSWORD.sub(lambda m: f"{m['key']}***", text)


def management_url_for(url: str) -> str:
    """The management API of the broker ``url`` names, where none is given: the same host and
    credentials, RabbitMQ's default port (``http://...:15672``, ``https://...:15671`` for
    ``amqps://``). A bad URL is left to ``Settings.vhost`` to report."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a bad port: the default below; vhost reports it
    except ValueError:
        return DEFAULT_MANAGEMENT_URL
    secure = parts.scheme == "amqps"
    host = parts.hostname or "localhost"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    # No user in the URL: AMQP clients log in as guest, and so does this.
    userinfo = parts.netloc.rpartition("@")[0] or "guest:guest"
    return (
        f"{'https' if secure else 'http'}://{userinfo}@"
        f"{host}:{15671 if secure else 15672}"
    )


def split_urls(values: str | Iterable[str] | None) -> tuple[str, ...]:
    """The URLs of ``values``: a comma-separated list, or several (a repeated option), each of
    which may itself be a list; blanks dropped. (A comma inside a password is written ``%2C``.)
    """
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(part.strip() for value in values for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class Settings:
    """Where the broker is. The vhost always comes from the AMQP URL, never from a topology file.

    ``url`` and ``management_url`` are the first node's; ``more_urls`` and
    ``more_management_urls`` are the other nodes of the same cluster, tried in order after it
    when a node is down or goes away (``urls``, ``management_urls``: all of them).

    ``ca_file``, ``cert_file`` and ``key_file`` (PEM) are used for ``amqps://`` and for an
    ``https://`` management URL; without them both fall back to the libraries' defaults (the
    system trust store, and for ``amqps://`` any ``cafile=...`` options in the URL's query).
    """

    url: str = DEFAULT_URL
    management_url: str = DEFAULT_MANAGEMENT_URL
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    key_password: str | None = field(default=None, repr=False)
    more_urls: tuple[str, ...] = ()
    more_management_urls: tuple[str, ...] = ()

    @classmethod
    def from_env(
        cls,
        url: str | Iterable[str] | None = None,
        management_url: str | Iterable[str] | None = None,
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        key_password: str | None = None,
    ) -> Settings:
        urls = split_urls(url) or split_urls(os.environ.get(URL_ENV)) or (DEFAULT_URL,)
        management_urls = (
            split_urls(management_url)
            or split_urls(os.environ.get(MANAGEMENT_URL_ENV))
            or tuple(management_url_for(u) for u in urls)
        )
        settings = cls(
            url=urls[0],
            management_url=management_urls[0],
            more_urls=urls[1:],
            more_management_urls=management_urls[1:],
            ca_file=ca_file or os.environ.get(CA_FILE_ENV) or None,
            cert_file=cert_file or os.environ.get(CERT_FILE_ENV) or None,
            key_file=key_file or os.environ.get(KEY_FILE_ENV) or None,
            key_password=key_password or os.environ.get(KEY_PASSWORD_ENV) or None,
        )
        settings.vhost  # noqa: B018 - validates the URL early, before anything touches the broker
        if settings.has_tls_files:
            settings.check_tls()
        return settings

    @property
    def urls(self) -> tuple[str, ...]:
        """Every AMQP URL, in the order they are tried."""
        return (self.url, *self.more_urls)

    @property
    def management_urls(self) -> tuple[str, ...]:
        """Every management API URL, in the order they are tried."""
        return (self.management_url, *self.more_management_urls)

    @property
    def url_list(self) -> str:
        """``urls`` as one ``--url`` value (comma-separated)."""
        return ",".join(self.urls)

    @property
    def management_url_list(self) -> str:
        """``management_urls`` as one ``--management-url`` value (comma-separated)."""
        return ",".join(self.management_urls)

    def nodes(self) -> tuple[Settings, ...]:
        """One ``Settings`` per AMQP URL, each naming that node alone, in order."""
        return tuple(replace(self, url=u, more_urls=()) for u in self.urls)

    @property
    def has_tls_files(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)

    def check_tls(self) -> None:
        """Fails (``InputError``, exit 2) on TLS files that are missing or unreadable, or that
        nothing would use: the user meant to encrypt, so silently talking plain is wrong."""
        amqps = any(urlsplit(u).scheme == "amqps" for u in self.urls)
        if not (amqps or self._management_https):
            raise InputError(
                "--ca-file / --cert-file / --key-file given, but neither --url "
                f"({self.safe_url}) is amqps:// nor --management-url "
                f"({self.safe_management_url}) is https://"
            )
        self.tls_context()

    def tls_context(self) -> ssl.SSLContext:
        """A fresh client context from the TLS files (re-read each time, so a reconnecting
        worker picks up rotated certificates)."""
        from rabbit_retry.tls import client_context  # only TLS needs it

        return client_context(self.ca_file, self.cert_file, self.key_file, self.key_password)

    def amqp_tls(self) -> ssl.SSLContext | None:
        """The context for an ``amqps://`` URL when TLS files were given, else None (aiormq's
        own handling of the URL, as before)."""
        if urlsplit(self.url).scheme != "amqps" or not self.has_tls_files:
            return None
        return self.tls_context()

    def management_tls(self) -> ssl.SSLContext | None:
        """The context for an ``https://`` management URL when TLS files were given, else None
        (httpx's default verification)."""
        if not self._management_https or not self.has_tls_files:
            return None
        return self.tls_context()

    @property
    def _management_https(self) -> bool:
        return any(urlsplit(u).scheme == "https" for u in self.management_urls)

    @property
    def vhost(self) -> str:
        """The vhost of the AMQP URLs: an empty path means ``/``, as the AMQP URI spec says.
        Every node's URL must name the same one."""
        vhosts = {_vhost_of(u) for u in self.urls}
        if len(vhosts) > 1:
            raise InputError(
                f"--url: the nodes name different vhosts ({', '.join(map(repr, sorted(vhosts)))});"
                " the nodes of one cluster serve the same vhost"
            )
        return vhosts.pop()

    @property
    def user(self) -> str:
        """The user of the AMQP URL, as the broker knows it: unquoted, and ``guest`` when the
        URL names none (aio-pika logs in as guest then)."""
        return unquote(urlsplit(self.url).username or "guest")

    def for_vhost(self, vhost: str) -> Settings:
        """The same broker, another vhost (tests use this for their throwaway vhosts)."""
        path = "/" + quote(vhost, safe="")
        urls = [urlunsplit(urlsplit(u)._replace(path=path)) for u in self.urls]
        return replace(self, url=urls[0], more_urls=tuple(urls[1:]))

    @property
    def safe_url(self) -> str:
        return mask(self.url_list)

    @property
    def safe_management_url(self) -> str:
        return mask(self.management_url_list)


def _vhost_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        raise InputError(f"--url: expected an amqp:// or amqps:// URL, got {mask(url)!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number from 0 to 65535
    except ValueError:
        raise InputError(
            f"--url: the port of {mask(url)!r} is not a number from 1 to 65535"
        ) from None
    path = parts.path
    if path in ("", "/"):
        return "/"
    return unquote(path[1:])
