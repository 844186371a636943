"""Shared fixtures: a throwaway vhost per test session (and per test where it needs a clean
slate) on the real broker, and an in-process runner for the ``rabbit-retry`` command."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings

BASE = Settings.from_env(
    os.environ.get("RABBIT_RETRY_TEST_URL"), os.environ.get("RABBIT_RETRY_TEST_MANAGEMENT_URL")
)
SESSION_ID = uuid.uuid4().hex[:8]


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture(scope="session")
def management() -> Iterator[Management]:
    with Management.for_settings(BASE) as api:
        try:
            api.overview()
        except BrokerError as exc:
            pytest.fail(f"integration tests need RabbitMQ with its management plugin: {exc}")
        yield api


@pytest.fixture(scope="session")
def vhost_factory(management: Management) -> Iterator[Callable[[], Settings]]:
    """Makes throwaway vhosts named for this session; deletes every one of them at the end."""
    made: list[str] = []

    def make() -> Settings:
        name = f"rr-test-{SESSION_ID}-{len(made)}"
        management.create_vhost(name, user=BASE.user)
        made.append(name)
        return BASE.for_vhost(name)

    yield make
    for name in made:
        management.delete_vhost(name)


@pytest.fixture(scope="session")
def session_vhost(vhost_factory: Callable[[], Settings]) -> Settings:
    return vhost_factory()


@pytest.fixture
def fresh_vhost(
    vhost_factory: Callable[[], Settings], management: Management
) -> Iterator[Settings]:
    """A vhost of the test's own, for tests that must see an empty broker.

    Deleted as soon as the test ends: RabbitMQ 3.x reserves file handles for every quorum
    queue, and a whole session's worth of them would stall the node.
    """
    settings = vhost_factory()
    yield settings
    management.delete_vhost(settings.vhost)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Runs ``rabbit-retry ARGS`` in-process against ``settings``; returns code, stdout, stderr."""
    from rabbit_retry.cli import main

    def run(*args: str, settings: Settings | None = None) -> CliResult:
        argv = list(args)
        if settings is not None:
            argv = ["--url", settings.url_list, "--management-url", settings.management_url_list,
                    *argv]
        capsys.readouterr()
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run
