"""Connection settings: AMQP and management URLs (one node, or the nodes of one cluster), the
vhost they name, TLS files, and password masking."""

from __future__ import annotations

import functools
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

# A URL's password in free text (a library's message): up to the last ``@`` before the host
# (one holding ``@`` or ``/`` included). A password with whitespace cannot be told from the text
# around it: ``parse_url`` refuses such a URL before any library sees it, and a URL on its own
# is printed through ``shown``.
_USERINFO = re.compile(
    r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>\S*?)@(?=[^@\s/]*(?:[/\s]|$))"
)


# libpq and redis-py also take the password as a query parameter (``?password=...``).
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&]password=)[^&\s]*", re.IGNORECASE)


def mask(text: str) -> str:
    """Replace the password of every URL in ``text`` with ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _QUERY_PASSWORD.sub(lambda m: f"{m['key']}***", text)


def shown(url: str) -> str:
    """``url`` as it may be printed: everything between the user's ``:`` and the last ``@``
    replaced with ``***``, however malformed the URL (a password with spaces, an unencoded
    ``@``, ``/``, ``?``, ``#`` or ``:``): what comes before the last ``@`` may be a password."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, where = rest.rpartition("@")
    if not at:
        return _QUERY_PASSWORD.sub(lambda m: f"{m['key']}***", url)
    user, colon, _ = userinfo.partition(":")
    where = _QUERY_PASSWORD.sub(lambda m: f"{m['key']}***", where)
    return f"{scheme}{sep}{user}{':***' if colon else ''}@{where}"


# What RFC 3986 allows in a user name or password as written: unreserved characters, percent
# escapes, sub-delimiters and ``:`` (the first ``:`` ends the user name); any other letter too.
_BAD_USERINFO = re.compile(r"[\s@/?#\[\]\\\"<>^`{|}\x00-\x1f\x7f]|%(?![0-9A-Fa-f]{2})")
_ENCODE = "write a space as %20, @ as %40, / as %2F, ? as %3F, # as %23, % as %25"


@dataclass(frozen=True)
class ParsedURL:
    """One AMQP or management URL, read once by ``parse_url``: user and password decoded (as the
    broker knows them), ``shown`` the URL without its password."""

    scheme: str
    userinfo: str = field(repr=False)  # as written: ``user:password``, percent-encoded
    user: str | None
    password: str | None = field(repr=False)
    host: str
    port: int | None
    path: str  # as written (percent-encoded)
    query: str
    shown: str


@functools.lru_cache(maxsize=64)
def parse_url(url: str, option: str = "--url",
              schemes: tuple[str, ...] = ("amqp", "amqps")) -> ParsedURL:
    """``url`` read as RFC 3986 says, or ``InputError`` (exit 2) in one line that never holds
    its password: a user name or password must be percent-encoded, so a URL whose userinfo holds
    a space, an ``@``, ``/``, ``?`` or ``#`` as it is (which would move the host, the vhost or the
    query into the password, or the password into them) is refused, not guessed at."""
    safe = shown(url)
    expected = ("http(s)://user:pass@host:port" if "http" in schemes
                else "an " + " or ".join(f"{s}://" for s in schemes) + " URL")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise InputError(f"{option}: expected {expected}, got {safe!r}")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo, at, _ = authority.rpartition("@")
    if "@" in rest[len(authority):] or (at and _BAD_USERINFO.search(userinfo)):
        raise InputError(
            f"{option}: {safe!r} is ambiguous: its user name, password or vhost holds a "
            f"character that must be percent-encoded ({_ENCODE})"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InputError(
            f"{option}: the port of {safe!r} is not a number from 1 to 65535"
        ) from None
    host = parts.hostname
    if host and re.search(r"[\s,%]", host):
        raise InputError(f"{option}: {host!r} in {safe!r} is not a host name")
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return ParsedURL(scheme=scheme.lower(), userinfo=userinfo, user=user, password=password,
                     host=host or "", port=port, path=parts.path, query=parts.query, shown=safe)


def management_url_for(url: str) -> str:
    """The management API of the broker ``url`` names, where none is given: the same host and
    credentials, RabbitMQ's default port (``http://...:15672``, ``https://...:15671`` for
    ``amqps://``). A bad URL is left to ``Settings.vhost`` to report."""
    try:
        parts = parse_url(url)
    except InputError:
        return DEFAULT_MANAGEMENT_URL
    secure = parts.scheme == "amqps"
    host = parts.host or "localhost"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    # No user in the URL: AMQP clients log in as guest, and so does this. (Still encoded.)
    userinfo = parts.userinfo or "guest:guest"
    return (
        f"{'https' if secure else 'http'}://{userinfo}@"
        f"{host}:{15671 if secure else 15672}"
    )


# A comma that starts the next URL of a list: one followed by a scheme.
_NEXT_URL = re.compile(r",(?=[\s,]*[a-zA-Z][a-zA-Z0-9+.-]*://)")


def split_urls(values: str | Iterable[str] | None) -> tuple[str, ...]:
    """The URLs of ``values``: a comma-separated list, or several (a repeated option), each of
    which may itself be a list; blanks dropped. Only a comma followed by ``scheme://`` starts
    another URL, so a comma in a password is part of it (``%2C`` works too)."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(part.strip(" \t\n,") for value in values for part in _NEXT_URL.split(value)
                 if part.strip(" \t\n,"))


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
        settings.vhost  # noqa: B018 - validates the URLs early, before anything touches the broker
        for u in settings.management_urls:
            parse_url(u, "--management-url", ("http", "https"))
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
        amqps = any(parse_url(u).scheme == "amqps" for u in self.urls)
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
        if parse_url(self.url).scheme != "amqps" or not self.has_tls_files:
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
        return any(u.lower().startswith("https://") for u in self.management_urls)

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
        return parse_url(self.url).user or "guest"

    def for_vhost(self, vhost: str) -> Settings:
        """The same broker, another vhost (tests use this for their throwaway vhosts)."""
        path = "/" + quote(vhost, safe="")
        urls = [urlunsplit(urlsplit(u)._replace(path=path)) for u in self.urls]
        return replace(self, url=urls[0], more_urls=tuple(urls[1:]))

    @property
    def safe_url(self) -> str:
        return ",".join(map(shown, self.urls))

    @property
    def safe_management_url(self) -> str:
        return ",".join(map(shown, self.management_urls))

    def __repr__(self) -> str:
        return (f"Settings(url={self.safe_url!r}, management_url={self.safe_management_url!r}, "
                f"ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, "
                f"key_file={self.key_file!r})")


def _vhost_of(url: str) -> str:
    path = parse_url(url).path
    if path in ("", "/"):
        return "/"
    return unquote(path[1:])
