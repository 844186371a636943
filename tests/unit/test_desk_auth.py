"""Who may use the desk (pure): access files, secrets, session cookies, Host names, throttling."""

from __future__ import annotations

from pathlib import Path

import pytest

from rabbit_retry.desk.auth import (
    LOOPBACK,
    OPERATOR,
    OPERATORS,
    TOKEN,
    VIEWER,
    Identity,
    Secret,
    Throttle,
    csrf_for,
    hash_secret,
    host_allowed,
    load_access,
    sign,
    unsign,
)
from rabbit_retry.errors import InputError

KEY = b"k" * 32


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "access.yml"
    path.write_text(text)
    return path


def test_the_mode_follows_what_is_configured(tmp_path: Path) -> None:
    assert load_access(None, None).mode == LOOPBACK
    token = load_access(None, "a-token-of-16-chars")
    assert token.mode == TOKEN
    assert token.by_token("a-token-of-16-chars") == Identity("token", OPERATOR, "token")
    assert token.by_token("wrong") is None
    hashed = hash_secret("ana's secret")
    access = load_access(_file(tmp_path, f"""
operators:
  ana: {{role: operator, secret: "{hashed}"}}
  vic: {{secret_env: VIC}}
metrics: {{secret_env: SCRAPE}}
hosts: [Desk.Example.com]
"""), None, env={"VIC": "v" * 16, "SCRAPE": "s" * 16})
    assert access.mode == OPERATORS and access.sessions
    assert access.operator("ana", "ana's secret") == Identity("ana", OPERATOR, "secret")
    assert access.operator("ana", "guess") is None
    assert access.operator("vic", "v" * 16) == Identity("vic", VIEWER, "secret")
    assert access.operator("nobody", "v" * 16) is None
    assert access.by_metrics("s" * 16) is not None and access.by_metrics("v" * 16) is None
    metrics = access.by_metrics("s" * 16)
    assert metrics is not None and not metrics.may_read and not metrics.may_act
    assert access.hosts == {"desk.example.com"}


def test_a_trusted_proxy_is_believed_from_its_addresses_only(tmp_path: Path) -> None:
    access = load_access(_file(tmp_path, """
operators:
  ana: {role: operator}
proxy: {header: X-Forwarded-User, trusted: [10.0.0.0/24, "::1"], role: viewer}
"""), None)
    assert access.by_proxy("10.0.0.7", "ana") == Identity("ana", OPERATOR, "proxy")
    assert access.by_proxy("::1", "zed") == Identity("zed", VIEWER, "proxy")
    assert access.by_proxy("10.0.1.7", "ana") is None  # not the proxy: the header means nothing
    assert access.by_proxy("10.0.0.7", "") is None
    assert access.by_proxy("10.0.0.7", "a name\nwith a newline") is None
    assert not access.sessions  # nobody has a secret: no login form
    closed = load_access(_file(tmp_path, """
proxy: {header: X-User, trusted: [10.0.0.1], role: null}
operators: {ana: {role: operator}}
"""), None)
    assert closed.by_proxy("10.0.0.1", "zed") is None  # not listed, and no default role
    assert closed.by_proxy("10.0.0.1", "ana") is not None


@pytest.mark.parametrize(("text", "env", "says"), [
    ("operators: {ana: {role: admin, secret_env: A}}", {"A": "a" * 16},
     "operators.ana.role: Input should be 'viewer' or 'operator'"),
    ("operators: {ana: {secret_env: A}}", {"A": "short"},
     "operators.ana.secret_env: $A must hold a secret of at least 16 characters"),
    ("operators: {ana: {secret: plain-text}}", {},
     "operators.ana.secret: not scrypt$N$r$p$SALT$HASH (python -m rabbit_retry.desk.auth "
     "prints one)"),
    ("operators: {ana: {role: viewer}}", {},
     "operators.ana: needs a secret (or secret_env), or a proxy: section that vouches"),
    ("operators: {'a b': {secret_env: A}}", {"A": "a" * 16},
     "operators.'a b': a name of letters, digits and ._@+- (at most 64)"),
    ("operators: {ana: {secret_env: A, secret_env_x: B}}", {"A": "a" * 16},
     "operators.ana.secret_env_x: Extra inputs are not permitted"),
    ("proxy: {header: X-User, trusted: [not-an-ip]}", {},
     "proxy.trusted: 'not-an-ip' is not an IP address or network"),
    ("{}", {}, "names no operator and no proxy: nobody could use the desk"),
    ("- a list", {}, "expected a mapping (operators:, proxy:, metrics:, hosts:)"),
    ("operators: [", {}, "not YAML:"),
])
def test_an_access_file_that_cannot_work_is_one_line(tmp_path: Path, text: str,
                                                     env: dict[str, str], says: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(InputError) as caught:
        load_access(path, None, env=env)
    message = str(caught.value)
    assert message.startswith(f"{path}: {says}"), message
    assert "\n" not in message


def test_a_file_and_a_token_are_not_both_given(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not both"):
        load_access(_file(tmp_path, "operators: {}"), "a-token-of-16-chars")
    with pytest.raises(InputError, match="at least 16 characters"):
        load_access(None, "short")
    with pytest.raises(InputError, match="no such file"):
        load_access(tmp_path / "missing.yml", None)


def test_secrets_are_kept_hashed_and_compared_whole() -> None:
    stored = hash_secret("correct horse")
    assert stored.startswith("scrypt$16384$8$1$") and "correct" not in stored
    assert hash_secret("correct horse") != stored  # salted
    assert Secret(hashed=stored).matches("correct horse")
    assert not Secret(hashed=stored).matches("correct hors")
    assert not Secret(hashed=stored).matches("")
    assert Secret(plain="x" * 16).matches("x" * 16) and not Secret(plain="x" * 16).matches("x")
    assert Secret(hashed=stored).fingerprint != Secret(hashed=hash_secret("other")).fingerprint


def test_a_session_cookie_is_signed() -> None:
    cookie = sign("the-session-id", KEY)
    assert unsign(cookie, KEY) == "the-session-id"
    assert unsign(cookie, b"another key" * 3) is None
    assert unsign(cookie[:-1] + ("A" if cookie[-1] != "A" else "B"), KEY) is None
    assert unsign("the-session-id", KEY) is None
    assert unsign("", KEY) is None
    assert csrf_for("a", KEY) != csrf_for("b", KEY)


@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:8025", True), ("[::1]:8025", True), ("localhost:8025", True),
    ("LOCALHOST", True), ("10.1.2.3", True), ("desk.example.com", True),
    ("Desk.Example.com.:443", True),
    ("evil.example:18932", False), ("desk.example.com.evil.example", False), ("", False),
    (None, False),
])
def test_the_host_must_name_the_desk(host: str | None, allowed: bool) -> None:
    assert host_allowed(host, frozenset({"desk.example.com"})) is allowed


def test_failed_logins_lock_an_address_and_a_name_out_for_a_while() -> None:
    throttle = Throttle(allowed=3, initial=30, maximum=900)
    keys = [("address", "10.0.0.9"), ("name", "ana")]
    for _ in range(2):
        throttle.failed(keys)
        assert throttle.refused_for(keys) == 0  # the control: not locked yet
    throttle.failed(keys)
    first = throttle.refused_for(keys)
    assert 15 <= first <= 30
    assert throttle.refused_for([("address", "10.0.0.8")]) == 0  # another address
    assert throttle.refused_for([("name", "ana")]) > 0  # the name, from anywhere
    throttle.failed(keys)
    assert throttle.refused_for(keys) > first / 2  # longer each time (jittered)
    throttle.succeeded(keys)
    assert throttle.refused_for(keys) == 0


def test_the_hash_of_a_secret_is_printed_for_an_access_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    ran = subprocess.run([sys.executable, "-m", "rabbit_retry.desk.auth"],
                         input="a secret of ana's\n", capture_output=True, text=True, check=True)
    line = ran.stdout.strip()
    assert line.startswith('secret: "scrypt$') and "ana" not in line
    access = load_access(_file(tmp_path, f"operators:\n  ana: {{role: operator, {line}}}\n"),
                         None)
    assert access.operator("ana", "a secret of ana's") is not None
    short = subprocess.run([sys.executable, "-m", "rabbit_retry.desk.auth"], input="short\n",
                           capture_output=True, text=True)
    assert (short.returncode, short.stderr.strip()) == (
        1, "error: a secret of at least 16 characters")
