"""Settings: what the AMQP URL says beyond where the broker is."""

from __future__ import annotations

import pytest

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
