"""Who may use the desk and as whom (pure, apart from reading a file and the environment).

Four ways in, one of them chosen when the desk starts:

- ``loopback``: no credentials configured; the desk listens on loopback only and everyone who
  reaches it acts as ``loopback`` (an operator).
- ``token``: ``RABBIT_RETRY_DESK_TOKEN``, one shared secret, the quick start: everyone who holds
  it acts as ``token`` (an operator). The audit cannot tell two people apart in this mode.
- ``operators``: an access file (``--access FILE``) names each operator, a role (``viewer``:
  read, search, export; ``operator``: also replay, discard, restore, edit) and a secret of
  their own; optionally a read-only credential for ``/metrics``, and
- a trusted authenticating proxy (``proxy:`` in the same file): a request from one of its
  addresses carries the authenticated name in a header; the same header from anywhere else is
  ignored.

The audit records the name a request authenticated as, never one the client chose. Secrets are
kept as scrypt hashes (``hash_secret``; ``python -m rabbit_retry.desk.auth`` prints one) or read
from an environment variable the file names; they are compared in constant time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rabbit_retry.backoff import Backoff
from rabbit_retry.errors import InputError

VIEWER = "viewer"
OPERATOR = "operator"
METRICS = "metrics"  # the scraper's credential: /metrics and nothing else
ROLES = (VIEWER, OPERATOR)

LOOPBACK = "loopback"
TOKEN = "token"
OPERATORS = "operators"
MODES = (LOOPBACK, TOKEN, OPERATORS)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")
TOKEN_MIN = 16
SESSION_HOURS = 8.0

# scrypt at the cost OWASP suggests for interactive logins (about 50 ms, 16 MiB).
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1
_SCRYPT = "scrypt"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request authenticated as: the audit's actor, and what they may do."""

    name: str
    role: str  # viewer | operator | metrics
    how: str  # loopback | token | secret | proxy | session

    @property
    def may_act(self) -> bool:
        return self.role == OPERATOR

    @property
    def may_read(self) -> bool:
        return self.role in ROLES


# --- secrets -----------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_secret(secret: str, *, salt: bytes | None = None) -> str:
    """``scrypt$N$r$p$SALT$HASH``: what an access file keeps instead of a secret."""
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P,
                            dklen=32)
    return f"{_SCRYPT}${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${_b64(salt)}${_b64(digest)}"


def _parse_hash(stored: str) -> tuple[int, int, int, bytes, bytes]:
    parts = stored.split("$")
    if len(parts) != 6 or parts[0] != _SCRYPT:
        raise ValueError("not scrypt$N$r$p$SALT$HASH (python -m rabbit_retry.desk.auth prints one)")
    n, r, p = (int(x) for x in parts[1:4])
    if not (2 <= n <= 2**20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
        raise ValueError("scrypt parameters out of range")
    return n, r, p, _unb64(parts[4]), _unb64(parts[5])


@dataclass(frozen=True, slots=True)
class Secret:
    """One credential: an scrypt hash, or the secret itself (from the environment)."""

    hashed: str | None = None
    plain: str | None = field(default=None, repr=False)

    def matches(self, given: str) -> bool:
        if self.plain is not None:
            return hmac.compare_digest(given.encode(), self.plain.encode())
        assert self.hashed is not None
        n, r, p, salt, digest = _parse_hash(self.hashed)
        try:
            computed = hashlib.scrypt(given.encode(), salt=salt, n=n, r=r, p=p,
                                      dklen=len(digest))
        except (ValueError, MemoryError):
            return False
        return hmac.compare_digest(computed, digest)

    @property
    def fingerprint(self) -> str:
        """Changes when the secret changes: a session made with the old one ends."""
        source = self.hashed if self.hashed is not None else f"plain:{self.plain}"
        return hashlib.sha256(source.encode()).hexdigest()[:32]


# --- the access file ---------------------------------------------------------------------------


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _SecretSpec(_Spec):
    secret: str | None = None
    secret_env: str | None = None

    def resolve(self, where: str, env: Mapping[str, str]) -> Secret | None:
        if self.secret is not None and self.secret_env is not None:
            raise InputError(f"{where}: give secret or secret_env, not both")
        if self.secret is not None:
            try:
                _parse_hash(self.secret)
            except ValueError as exc:
                raise InputError(f"{where}.secret: {exc}") from None
            return Secret(hashed=self.secret)
        if self.secret_env is not None:
            value = env.get(self.secret_env, "")
            if len(value) < TOKEN_MIN:
                raise InputError(f"{where}.secret_env: ${self.secret_env} must hold a secret of "
                                 f"at least {TOKEN_MIN} characters")
            return Secret(plain=value)
        return None


class _OperatorSpec(_SecretSpec):
    role: Literal["viewer", "operator"] = "viewer"


class _ProxySpec(_Spec):
    header: str = Field(min_length=1, max_length=100)
    trusted: list[str] = Field(min_length=1)
    role: Literal["viewer", "operator"] | None = "viewer"  # of a name not under operators

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9-]+", value):
            raise ValueError("a header name (letters, digits and -)")
        return value


class _AccessSpec(_Spec):
    operators: dict[str, _OperatorSpec] = Field(default_factory=dict)
    metrics: _SecretSpec | None = None
    proxy: _ProxySpec | None = None
    hosts: list[str] = Field(default_factory=list)
    session_hours: float = Field(default=SESSION_HOURS, gt=0, le=24 * 30)


@dataclass(frozen=True, slots=True)
class Operator:
    name: str
    role: str
    secret: Secret | None  # None: known only through the proxy


@dataclass(frozen=True, slots=True)
class Proxy:
    header: str
    trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    role: str | None

    def trusts(self, address: str | None) -> bool:
        if not address:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.trusted)


@dataclass(frozen=True)
class Access:
    """Who may use this desk: the mode, its credentials, the Host names it answers to."""

    mode: str
    token: Secret | None = None
    operators: Mapping[str, Operator] = field(default_factory=dict)
    metrics: Secret | None = None
    proxy: Proxy | None = None
    hosts: frozenset[str] = frozenset()
    session_hours: float = SESSION_HOURS

    @property
    def sessions(self) -> bool:
        """Whether the page logs in (a secret to give) rather than being let in as it is."""
        return self.mode == TOKEN or any(o.secret for o in self.operators.values())

    def operator(self, name: str, given: str) -> Identity | None:
        """The operator ``name`` when ``given`` is their secret."""
        found = self.operators.get(name)
        if found is None or found.secret is None:
            # Spend the same time as a real check: a refusal must not tell who exists.
            _DUMMY.matches(given)
            return None
        if not found.secret.matches(given):
            return None
        return Identity(found.name, found.role, "secret")

    def by_token(self, given: str) -> Identity | None:
        if self.token is not None and self.token.matches(given):
            return Identity(TOKEN, OPERATOR, TOKEN)
        return None

    def by_metrics(self, given: str) -> Identity | None:
        if self.metrics is not None and self.metrics.matches(given):
            return Identity(METRICS, METRICS, "secret")
        return None

    def by_proxy(self, address: str | None, name: str | None) -> Identity | None:
        """The name the trusted proxy vouches for; None when the request is not the proxy's or
        names nobody this desk lets in."""
        if self.proxy is None or not name or not self.proxy.trusts(address):
            return None
        name = name.strip()
        if not NAME.fullmatch(name):
            return None
        known = self.operators.get(name)
        role = known.role if known is not None else self.proxy.role
        return Identity(name, role, "proxy") if role is not None else None

    def fingerprint(self, identity: Identity) -> str:
        """The credential a session was made with: a new secret (or token) ends old sessions."""
        if self.mode == TOKEN and self.token is not None:
            return self.token.fingerprint
        found = self.operators.get(identity.name)
        if found is not None and found.secret is not None:
            return hashlib.sha256(
                f"{found.role}:{found.secret.fingerprint}".encode()).hexdigest()[:32]
        return ""


_DUMMY = Secret(hashed=hash_secret("x", salt=b"\0" * 16))


def load_access(path: str | Path | None, token: str | None, *,
                env: Mapping[str, str] | None = None,
                hosts: Iterable[str] = ()) -> Access:
    """The access of a desk: the access file's when given, else the token's, else loopback."""
    env = os.environ if env is None else env
    extra_hosts = {h.strip().lower() for h in hosts if h.strip()}
    if path is not None and token:
        raise InputError("give --access FILE or RABBIT_RETRY_DESK_TOKEN, not both (the file "
                         "names each operator; the token is the quick start)")
    if path is None:
        if not token:
            return Access(LOOPBACK, hosts=frozenset(extra_hosts))
        if len(token) < TOKEN_MIN:
            raise InputError(f"RABBIT_RETRY_DESK_TOKEN: use at least {TOKEN_MIN} characters")
        return Access(TOKEN, token=Secret(plain=token), hosts=frozenset(extra_hosts))
    spec = _read(Path(path))
    source = str(path)
    operators = _operators(spec, source, env)
    metrics = spec.metrics.resolve(f"{source}: metrics", env) if spec.metrics else None
    proxy = None if spec.proxy is None else _proxy(spec.proxy, source)
    if not operators and proxy is None:
        raise InputError(f"{source}: names no operator and no proxy: nobody could use the desk")
    named = {h.strip().lower() for h in spec.hosts if h.strip()}
    return Access(OPERATORS, operators=operators, metrics=metrics, proxy=proxy,
                  hosts=frozenset(named | extra_hosts), session_hours=spec.session_hours)


def _operators(spec: _AccessSpec, source: str, env: Mapping[str, str]) -> dict[str, Operator]:
    operators: dict[str, Operator] = {}
    for name, operator in spec.operators.items():
        if not NAME.fullmatch(name):
            raise InputError(f"{source}: operators.{name!r}: a name of letters, digits and "
                             "._@+- (at most 64)")
        secret = operator.resolve(f"{source}: operators.{name}", env)
        if secret is None and spec.proxy is None:
            raise InputError(f"{source}: operators.{name}: needs a secret (or secret_env), or "
                             "a proxy: section that vouches for the name")
        operators[name] = Operator(name, operator.role, secret)
    return operators


def _proxy(spec: _ProxySpec, source: str) -> Proxy:
    networks = []
    for entry in spec.trusted:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise InputError(f"{source}: proxy.trusted: {entry!r} is not an IP address or "
                             "network") from None
    return Proxy(spec.header, tuple(networks), spec.role)


def _read(path: Path) -> _AccessSpec:
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{source}: cannot read it ({exc})") from None
    try:
        document = YAML(typ="safe", pure=True).load(text)
    except YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "not YAML"
        raise InputError(f"{source}: not YAML: {first}") from None
    if not isinstance(document, dict):
        raise InputError(f"{source}: expected a mapping (operators:, proxy:, metrics:, hosts:)")
    try:
        return _AccessSpec.model_validate(document)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise InputError(f"{source}: {where}: {error['msg']}") from None


# --- Host -------------------------------------------------------------------------------------


def host_name(host_header: str) -> str:
    """``Host: Desk.Example.com:8025`` -> ``desk.example.com``; ``[::1]:8025`` -> ``::1``."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def host_allowed(host_header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` names this desk: an IP address (what a browser sends when the
    address was typed: no DNS rebinding needs one), ``localhost``, or a name in ``allowed``."""
    if not host_header:
        return False
    name = host_name(host_header)
    if name == "localhost" or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


# --- sessions ---------------------------------------------------------------------------------


def new_session_id() -> str:
    return secrets.token_urlsafe(32)


def session_key_of(session_id: str) -> str:
    """What the store keeps of a session: never the id itself (a stolen copy of the store logs
    no one in)."""
    return hashlib.sha256(session_id.encode()).hexdigest()


def sign(session_id: str, key: bytes) -> str:
    """The session cookie: the id and its HMAC (a forged or altered cookie is refused before
    the store is asked)."""
    mac = hmac.new(key, session_id.encode(), hashlib.sha256).digest()
    return f"{session_id}.{_b64(mac)}"


def unsign(cookie: str, key: bytes) -> str | None:
    session_id, dot, mac = cookie.rpartition(".")
    if not dot or not session_id:
        return None
    expected = _b64(hmac.new(key, session_id.encode(), hashlib.sha256).digest())
    return session_id if hmac.compare_digest(mac.encode(), expected.encode()) else None


def csrf_for(session_id: str, key: bytes) -> str:
    """The page's CSRF token, bound to its session: a token planted by another site is not it."""
    return _b64(hmac.new(key, b"csrf:" + session_id.encode(), hashlib.sha256).digest())


# --- throttling -------------------------------------------------------------------------------


class Throttle:
    """Failed logins per address and per name: after ``allowed`` failures in a row, each key is
    refused for a while, right secret or not (``Backoff``: about 30 s, doubling with each
    further failure, at most 15 min). A success ends the key's streak."""

    def __init__(self, allowed: int = 5, *, initial: float = 30.0,
                 maximum: float = 900.0) -> None:
        self.allowed = allowed
        self.initial = initial
        self.maximum = maximum
        self._failures: dict[tuple[str, str], int] = {}
        self._lockouts: dict[tuple[str, str], Backoff] = {}
        self._until: dict[tuple[str, str], float] = {}

    def refused_for(self, keys: Iterable[tuple[str, str]]) -> float:
        """Seconds until every one of ``keys`` may try again (0: now)."""
        now = time.monotonic()
        return max(0.0, *(self._until.get(k, 0.0) - now for k in keys))

    def failed(self, keys: Iterable[tuple[str, str]]) -> None:
        now = time.monotonic()
        for key in keys:
            self._failures[key] = self._failures.get(key, 0) + 1
            if self._failures[key] >= self.allowed:
                lockout = self._lockouts.setdefault(key, Backoff(self.initial, self.maximum))
                self._until[key] = now + lockout.failed()
        if len(self._failures) > 100_000:  # a flood of names: forget the oldest half
            for key in list(self._failures)[:50_000]:
                self.succeeded([key])

    def succeeded(self, keys: Iterable[tuple[str, str]]) -> None:
        for key in keys:
            self._failures.pop(key, None)
            self._lockouts.pop(key, None)
            self._until.pop(key, None)


def main() -> None:
    """``python -m rabbit_retry.desk.auth``: a secret (typed, or made up with ``--new``) and the
    ``secret:`` line of an access file that accepts it."""
    import getpass
    import sys

    if "--new" in sys.argv[1:]:
        secret = secrets.token_urlsafe(24)
        print(f"secret (give it to its operator; it is not kept): {secret}", file=sys.stderr)
    elif sys.stdin.isatty():
        secret = getpass.getpass("secret: ")
    else:
        secret = sys.stdin.readline().rstrip("\n")
    if len(secret) < TOKEN_MIN:
        raise SystemExit(f"error: a secret of at least {TOKEN_MIN} characters")
    print(f"secret: \"{hash_secret(secret)}\"")


if __name__ == "__main__":
    main()
