"""Settings: what the AMQP URL says beyond where the broker is."""

from __future__ import annotations

import pytest
from support.cluster import starting_at

from rabbit_retry.settings import Settings


@pytest.mark.parametrize(
    ("url", "user"),
    [
        ("amqp://alice:pw@h:5672/v", "alice"),
        ("amqp://svc%40team:pw@h/", "svc@team"),  # unquoted, as the broker knows the user
        ("amqps://h:5671/", "guest"),  # no user in the URL: aio-pika logs in as guest
    ],
)
def test_user_of_the_url(url: str, user: str) -> None:
    assert Settings(url=url).user == user


# --- the nodes of a cluster ------------------------------------------------------------------


@pytest.mark.parametrize(
    "given",
    [
        "amqp://a/v,amqp://b/v,amqp://c/v",
        " amqp://a/v , amqp://b/v,,amqp://c/v ",
        ("amqp://a/v", "amqp://b/v", "amqp://c/v"),  # a repeated option
        ("amqp://a/v,amqp://b/v", "amqp://c/v"),  # both at once
    ],
)
def test_a_list_of_urls_names_the_nodes_in_order(given: str | tuple[str, ...]) -> None:
    settings = Settings.from_env(given)
    assert settings.urls == ("amqp://a/v", "amqp://b/v", "amqp://c/v")
    assert settings.url == "amqp://a/v"
    # Each node's management API follows its AMQP URL when none is given.
    assert settings.management_urls == tuple(f"http://guest:guest@{h}:15672" for h in "abc")
    assert settings.vhost == "v"
    assert [n.urls for n in settings.nodes()] == [("amqp://a/v",), ("amqp://b/v",),
                                                  ("amqp://c/v",)]


def test_a_management_list_is_taken_as_given() -> None:
    settings = Settings.from_env("amqp://a/,amqp://b/", "http://m1:1,http://m2:2,http://m3:3")
    assert settings.management_urls == ("http://m1:1", "http://m2:2", "http://m3:3")
    assert settings.management_url_list == "http://m1:1,http://m2:2,http://m3:3"


def test_the_list_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rabbit_retry.settings import MANAGEMENT_URL_ENV, URL_ENV

    monkeypatch.setenv(URL_ENV, "amqp://a/,amqp://b/")
    monkeypatch.setenv(MANAGEMENT_URL_ENV, "http://m1:1,http://m2:2")
    settings = Settings.from_env()
    assert settings.urls == ("amqp://a/", "amqp://b/")
    assert settings.management_urls == ("http://m1:1", "http://m2:2")


def test_every_node_serves_the_same_vhost() -> None:
    from rabbit_retry.errors import InputError

    with pytest.raises(InputError) as info:
        Settings.from_env("amqp://u:secret@a/one,amqp://u:secret@b/two")
    assert str(info.value) == (
        "--url: the nodes name different vhosts ('one', 'two'); the nodes of one cluster serve "
        "the same vhost"
    )
    with pytest.raises(InputError, match="not a number"):
        Settings.from_env("amqp://a/,amqp://b:x/")


def test_a_vhost_of_its_own_on_every_node() -> None:
    settings = Settings.from_env("amqp://u:p@a:1/,amqp://u:p@b:2/").for_vhost("t/1")
    assert settings.urls == ("amqp://u:p@a:1/t%2F1", "amqp://u:p@b:2/t%2F1")
    assert settings.vhost == "t/1"


def test_starting_at_another_node_keeps_the_others_in_order() -> None:
    settings = Settings.from_env("amqp://a/,amqp://b/,amqp://c/")
    assert starting_at(settings, 1).urls == ("amqp://b/", "amqp://c/", "amqp://a/")
    assert starting_at(settings, 5).urls == ("amqp://c/", "amqp://a/", "amqp://b/")
    assert starting_at(settings, 0) == settings


def test_passwords_of_every_node_are_masked() -> None:
    settings = Settings.from_env("amqp://u:s1@a/,amqp://u:s2@b/", "http://u:s3@m:1,http://u:s4@n:2")
    shown = settings.safe_url + settings.safe_management_url + repr(settings)
    assert "s1" not in settings.safe_url and "s2" not in settings.safe_url
    assert settings.safe_url == "amqp://u:***@a/,amqp://u:***@b/"
    assert "s3" not in shown.replace(repr(settings), "")
