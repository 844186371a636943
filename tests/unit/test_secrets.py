"""Passwords in URLs are never printed, however the URL is written (reserved characters as they
are or percent-encoded), and an encoded password reaches both AMQP and the management API
decoded."""

from __future__ import annotations

import base64
from pathlib import Path
from urllib.parse import quote, unquote

import aiormq.exceptions
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rabbit_retry.broker.connect import describe_connect_error
from rabbit_retry.broker.management import Management
from rabbit_retry.cli import main
from rabbit_retry.errors import InputError
from rabbit_retry.settings import Settings, mask, parse_url, shown

# A distinctive start, so that "the password appears" cannot be a coincidence, then anything,
# with the characters that end or split a URL's parts over-represented.
RESERVED = " @/#?:,%!$&'()*+;=[]"
passwords = st.builds(
    lambda tail: "Zq9" + tail,
    st.text(alphabet=st.sampled_from(RESERVED) | st.characters(codec="utf-8",
                                                              exclude_categories=("Cs",)),
            min_size=1, max_size=16),
)
forms = st.sampled_from([
    "amqp://u:{pw}@127.0.0.1:1/plat-b",
    "amqp://u:{pw}@127.0.0.1/",
    "amqps://svc:{pw}@broker.internal:5671/a%2Fb?heartbeat=5",
    "amqp://u:{pw}@[::1]:1/v",
    "amqp://u%3Ax:{pw}@127.0.0.1:1/v",
])


def _secrets(pw: str) -> set[str]:
    return {pw, unquote(pw), quote(pw, safe=""), pw.strip()} - {""}


def _leaks(text: str, pw: str) -> list[str]:
    return [s for s in _secrets(pw) if len(s) >= 3 and s in text]


@settings(max_examples=400, deadline=None)
@given(pw=passwords, form=forms)
def test_a_password_as_written_is_never_in_an_error_or_a_shown_url(pw: str, form: str) -> None:
    url = form.format(pw=pw)
    try:
        configured = Settings.from_env(url, "http://u:" + pw + "@127.0.0.1:1")
    except InputError as exc:
        assert not _leaks(str(exc), pw), str(exc)
        return
    # Accepted: then it was read exactly as written, never with the host moved into it.
    parsed = parse_url(url)
    assert parsed.host in ("127.0.0.1", "broker.internal", "::1")
    assert parsed.password == unquote(pw)
    shown = configured.safe_url + configured.safe_management_url + repr(configured)
    assert not _leaks(shown, pw), shown
    for failure in (
        aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED"),
        ConnectionRefusedError(111, "Connect call failed"),
        TimeoutError(),
        OSError(f"cannot reach {url}"),
        RuntimeError(f"something about {url}"),
    ):
        line = describe_connect_error(failure, configured)
        assert not _leaks(line, pw), line


@settings(max_examples=100, deadline=None)  # each opens a client: slower
@given(pw=passwords, form=forms)
def test_an_encoded_password_is_accepted_and_decoded_for_both_apis(pw: str, form: str) -> None:
    encoded = quote(pw, safe="")
    url = form.format(pw=encoded)
    configured = Settings.from_env(url)
    parsed = parse_url(url)
    assert parsed.password == pw
    # The management API follows --url: basic auth gets the decoded password.
    with Management.for_settings(configured) as api:
        auth = api._nodes[0][2].auth
        assert auth is not None
        request = next(auth.sync_auth_flow(httpx.Request("GET", "http://x")))
        header = request.headers["Authorization"]
    assert base64.b64decode(header.split()[1]).decode() == f"{parsed.user}:{pw}"
    for text in (configured.safe_url, configured.safe_management_url, repr(configured),
                 mask(f"connecting to {url} failed"), mask(f"GET {configured.management_url}")):
        assert not _leaks(text, pw), text


@pytest.mark.parametrize("pw", ["Zq9SECRET pw", "Zq9p@ss", "Zq9a/b", "Zq9a#b", "Zq9a?b",
                                "Zq9a:b@c", "Zq9%zz", "Zq9a,amqp"])
def test_the_cli_never_prints_a_password_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pw: str
) -> None:
    topology = tmp_path / "t.yml"
    topology.write_text("version: 1\nqueues:\n  q: {}\n")
    for verb in (["status", str(topology)], ["plan", str(topology)], ["parking", "show", "q"],
                 ["status", str(topology), "--debug"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*verb, "--url", f"amqp://u:{pw}@127.0.0.1:1/plat-b"])
        out, err = capsys.readouterr()
        assert exit_info.value.code in (1, 2)
        assert not _leaks(out + err, pw), (verb, err)
        assert err.strip(), verb


def test_a_password_with_a_space_is_refused_in_one_line_without_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["parking", "show", "q", "--url", "amqp://u:Zq9SECRET pw@127.0.0.1:5673/plat-b"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: --url: 'amqp://u:***@127.0.0.1:5673/plat-b' is ambiguous: its user name, "
        "password or vhost holds a character that must be percent-encoded (write a space as "
        "%20, @ as %40, / as %2F, ? as %3F, # as %23, % as %25)\n"
    )


@pytest.mark.parametrize(
    ("url", "password", "vhost"),
    [
        ("amqp://u:a:b@h/v", "a:b", "v"),  # the first ':' ends the user name
        ("amqp://u:a,b@h/v", "a,b", "v"),  # a comma not followed by a URL is the password's
        ("amqp://u:p%40s%2Fs%20%23@h/t%40x", "p@s/s #", "t@x"),
    ],
)
def test_what_rfc_3986_allows_is_read_as_it_says(url: str, password: str, vhost: str) -> None:
    configured = Settings.from_env(url)
    assert (parse_url(url).password, configured.vhost, configured.urls) == (password, vhost, (url,))


def test_settings_do_not_show_the_key_password() -> None:
    assert "Zq9key" not in repr(Settings(key_password="Zq9key"))


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("x amqp://u:Zq9p@h/v,amqp://u:Zq9q@h2/v y", "x amqp://u:***@h/v,amqp://u:***@h2/v y"),
        ("failed: amqp://u:Zq9p@ss@h/v", "failed: amqp://u:***@h/v"),  # an unencoded @
        ("failed: amqp://u:Zq9a/b@h:1/v (x)", "failed: amqp://u:***@h:1/v (x)"),  # and /
        ("postgresql://u:Zq9pw@h/db?password=Zq9zz", "postgresql://u:***@h/db?password=***"),
        ("http://host:15672/api/x", "http://host:15672/api/x"),  # no password: as it is
    ],
)
def test_a_password_in_free_text_is_masked(text: str, masked: str) -> None:
    assert mask(text) == masked


@pytest.mark.parametrize(
    "url",
    ["postgresql://app:Zq9 a@b/c#d?e@db.internal:5432/outbox",
     "redis://:Zq9 secret@cache:6379/0", "postgresql://app@db/x?password=Zq9 pw"],
)
def test_a_store_url_is_shown_without_its_password(url: str) -> None:
    from rabbit_retry.database import engine_url

    assert "Zq9" not in shown(url)
    try:
        engine_url(url.replace("postgresql", "mysql"))
    except InputError as exc:
        assert "Zq9" not in str(exc), str(exc)
    else:
        raise AssertionError("mysql is refused")
