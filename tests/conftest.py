"""Shared fixtures (a throwaway vhost per test session, and per test where it needs a clean
slate, on the real broker; an in-process runner for the ``rabbit-retry`` command) and where
each test runs.

Where a test runs: ``scripts/test.sh`` selects by marks (declared in pyproject.toml), and the
marks are given here, from the test's file, so a new test file is classified without a word in
it (``classify`` below):

- ``tests/unit/``: ``unit``. No broker, no server: runs once, before any broker is needed.
- Everything else: ``integration`` (it needs a broker; ``reliability`` and ``browser`` say
  more). It runs on the newest broker of the matrix (4.3), in parallel with the others
  (pytest-xdist: each test has a vhost of its own), and also on every other version (3.10,
  4.0) unless it is ``any_version``.
- ``any_version``: what the test checks is ours and the same on every RabbitMQ version (the
  broker only carries messages: the desk's store and page, the benchmark harness, TLS against
  a node of its own, refusals made before the broker is asked). A test whose outcome depends
  on a broker behaviour that changed between versions (queue types and their arguments,
  dead-lettering and ``x-death``, delivery and return counts, the delivery limit, policies,
  the management API's fields, the broker's own error texts) must not be ``any_version``.
  When unsure, leave it out: the cost is minutes, the other mistake is a version untested.
- ``alone``: stops or restarts the broker, or needs it to itself: runs after the parallel
  run, one test at a time.
- ``cluster``: runs again in the cluster stage (three 4.3 nodes); ``needs_cluster``: skips
  without that cluster, so it runs only there.

A new test in a new file of ``tests/integration/`` or ``tests/reliability/`` runs on every
version: to say otherwise, add its file (or ``file::test``) to the tables below, or write
``pytestmark = pytest.mark.any_version`` (or ``alone``, ...) in it.

Order: every stage starts with the tests of ``SLOW`` (the slowest, slowest first), then the other
fault-injection tests, so a stage does not end waiting on one long test. A test that ``pytest
--durations`` shows among the slowest (half a minute or more) belongs in ``SLOW``.
"""

from __future__ import annotations

import fnmatch
import os
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.report import add_notes
from support.vhosts import create_vhost, delete_vhost

from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError
from rabbit_retry.settings import Settings

BASE = Settings.from_env(
    os.environ.get("RABBIT_RETRY_TEST_URL"), os.environ.get("RABBIT_RETRY_TEST_MANAGEMENT_URL")
)
SESSION_ID = uuid.uuid4().hex[:8]
TESTS = Path(__file__).resolve().parent

# Patterns of ``path/under/tests.py`` or ``path.py::test_name[id]`` (fnmatch), one table per mark.
ANY_VERSION = (
    "browser/*",  # the desk's page; its broker side is the desk's API, tested per version
    "test_bench_smoke.py",  # the harness's report; the benchmarks measure, never assert
    "integration/test_desk_store.py",  # the desk's store on SQLite and PostgreSQL: no broker
    "integration/test_desk_outbox_postgresql.py",  # the desk on a PostgreSQL outbox: no broker
    # Who may use the desk, its answers to bad or generated input, issue 22's findings: ours.
    "integration/test_desk_security.py",
    "integration/test_desk_fuzz.py",
    "integration/test_desk_findings.py",
    "integration/test_idempotency_stores.py",  # SQLite, PostgreSQL, Redis: no broker
    "integration/test_quickstart.py",  # the README's script; its loop is tested per version
    "reliability/test_tls.py",  # our TLS client against a 3.10 node of its own
    "reliability/test_bad_topology.py",  # refused before the broker is asked
    "integration/test_provision_corpus.py::test_bad_file_is_refused_*",  # the same
    # Which part of a file --target selects, and a closed pipe under plan and status: ours.
    "integration/test_provision_ci.py::test_a_target_repairs_*",
    "integration/test_provision_ci.py::test_plan_and_status_into_a_closed_pipe_*",
    # What the desk answers to bad requests and without its token, and what the commands refuse
    # before they ask the broker anything (or with it unreachable): ours. (Their broker only
    # holds the few parked messages the fixtures park.)
    "integration/test_desk.py::test_bad_requests_get_one_line_and_change_nothing*",
    "integration/test_desk.py::test_with_a_token_every_request_needs_it_*",
    "integration/test_desk.py::test_without_a_token_the_desk_refuses_to_listen_*",
    "integration/test_parking.py::test_export_into_a_missing_directory_is_refused*",
    "integration/test_parking.py::test_without_yes_and_without_a_terminal_nothing_changes*",
    "integration/test_parking.py::test_bad_filters_are_exit_2*",
    "integration/test_parking.py::test_an_unreachable_broker_is_exit_1",
    "integration/test_provision.py::test_validate_*",
    "integration/test_provision.py::test_export_mermaid_and_stdout",
    "integration/test_provision.py::test_names_amqp_clients_cannot_send_*",
    "integration/test_provision.py::test_unreachable_broker_is_one_line_exit_1",
    # The store's side of a killed desk; the broker's side runs per version on SQLite.
    "reliability/test_desk_killed.py::*[[]postgresql[]]",
    # The outbox's: its schema (no broker), a PostgreSQL outbox's side (the broker's side runs
    # per version on SQLite), and what the store and add do without a broker.
    # A relay killed mid-stream (either store): the lease, the in-flight window and the order
    # are the relay's; the broker only confirms publishes into a classic queue, alike on every
    # version. What the broker's side does to a publishing relay (a restart under it) runs per
    # version: reliability/test_outbox_broker_restart.py.
    "integration/test_outbox_schema.py",
    "integration/test_outbox.py::*postgresql*",
    "integration/test_outbox.py::test_an_unknown_destination_*",
    "integration/test_outbox.py::test_a_connection_in_autocommit_mode_*",
    "integration/test_outbox.py::test_published_and_discarded_events_older_than_keep_*",
    "integration/test_outbox.py::test_dead_events_are_listed_*",
    "integration/test_outbox.py::test_the_relay_command_refuses_bad_input_*",
    "reliability/test_outbox_killed.py",
)
ALONE = (
    "reliability/test_worker_faults.py::test_broker_app_stopped_and_started_mid_stream_*",
    "reliability/test_outbox_broker_restart.py",
    "reliability/test_ordered_faults.py::test_ordered_keys_survive_a_broker_restart",
)
CLUSTER = (
    "integration/test_cluster_urls.py",
    "reliability/test_refusals.py",
)
NEEDS_CLUSTER = (
    "integration/test_cluster_status.py",
    "reliability/test_cluster.py",
    "reliability/test_outbox_cluster.py",
    "integration/test_cluster_urls.py::test_amqp_and_management_on_different_nodes_*",
)
# Tests that must not run beside each other, per group: each group's tests run one after another
# on one xdist worker (``--dist loadgroup``), beside the rest of the stage.
GROUPS = {
    # Share a costly module fixture (a TLS node of their own).
    "tls": ("reliability/test_tls.py",),
    # The rescue tests shorten the broker's retry interval for held dead letters while they
    # declare their queues (a broker-wide setting that a quorum queue declared meanwhile keeps),
    # and each puts back what it read: two of them at once could leave it short. The
    # missing-object tests hold dead letters for the default 3 minutes and saw them retried
    # early beside them (rel.payments, 4.3).
    "dead-letter-interval": ("integration/test_rescue.py", "reliability/test_missing_objects.py"),
}
# The slowest tests, slowest first (per-test durations on 4.3 at 4 workers, `--durations`): a
# stage starts them first, so its parallel workers do not end waiting on one long test. Order
# only; a test missing here runs after them (the fault-injection ones first), as before.
SLOW = (
    "test_bench_smoke.py",
    "reliability/test_outbox_killed.py::*",
    "reliability/test_desk_killed.py::*",
    "integration/test_parking.py::test_a_replay_right_after_an_export_and_a_show_*",
    "reliability/test_crash_loop.py::*",
    "integration/test_quickstart.py",
    "reliability/test_migrate_killed.py::*",
    "integration/test_provision_ci.py::test_a_renamed_queue_is_reported_and_pruned_*",
    "reliability/test_missing_objects.py::*",
    "reliability/test_coalesced_acks.py::*",
    "reliability/test_bad_topology.py",
    "integration/test_worker_cancel.py::test_entering_probation_while_busy_*",
    "integration/test_desk.py::test_a_parking_queue_deleted_under_the_desk_*",
    "reliability/test_worker_faults.py::*",
    "integration/test_provision_ci.py::test_a_target_repairs_*",
    "integration/test_outbox.py::test_two_relays_on_one_postgresql_outbox_*",
    "integration/test_provision_ci.py::test_a_second_apply_refuses_or_waits_*",
    "integration/test_desk_operations.py::test_a_thousand_sku_key_errors_*",
    "integration/test_worker_resilience.py::test_a_paused_queue_rides_out_an_outage_*",
    "integration/test_migrate_move.py::test_a_refill_larger_than_the_window_*",
    "integration/test_worker.py::test_crash_loops_on_a_delivery_limited_quorum_queue_*",
    "reliability/test_idempotent_workers.py::*",
    "reliability/test_replay_killed.py::*",
    "integration/test_provision_ci.py::test_discard_messages_deletes_an_orphan_*",
)


def _matches(patterns: tuple[str, ...], path: str, test: str) -> bool:
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(test, p) for p in patterns)


def classify(item: pytest.Item) -> list[pytest.MarkDecorator]:
    """The marks of ``item`` from where it lives (see the module's docstring)."""
    path, test = _where(item)
    if path.startswith("unit/"):
        return [pytest.mark.unit]
    marks = [pytest.mark.integration]
    for directory in ("reliability", "browser"):
        if path.startswith(f"{directory}/"):
            marks.append(getattr(pytest.mark, directory))
    for name, table in (("any_version", ANY_VERSION), ("alone", ALONE), ("cluster", CLUSTER),
                        ("needs_cluster", NEEDS_CLUSTER)):
        if _matches(table, path, test):
            marks.append(getattr(pytest.mark, name))
    for group, patterns in GROUPS.items():
        if _matches(patterns, path, test):
            marks.append(pytest.mark.xdist_group(group))
    return marks


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed call's report gets what its fixtures noted (support/report.py)."""
    report: pytest.TestReport = yield
    if report.when == "call" and report.failed:
        add_notes(item, report)
    return report


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by them
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in classify(item):
            item.add_marker(mark)
    # The slowest tests first (SLOW), then the other fault-injection tests, so parallel workers
    # do not end on long tests one by one. A stable sort: the rest keep their order.
    items.sort(key=_start_rank)


def _where(item: pytest.Item) -> tuple[str, str]:
    """``item``'s file under tests/ and its ``file::test[id]``, as the tables name them."""
    path = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
    return path, f"{path}::{item.name}"


def _start_rank(item: pytest.Item) -> tuple[int, bool]:
    path, test = _where(item)
    rank = next((n for n, p in enumerate(SLOW) if _matches((p,), path, test)), len(SLOW))
    return rank, not item.get_closest_marker("reliability")


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
        create_vhost(management, name, BASE.user)
        made.append(name)
        return BASE.for_vhost(name)

    yield make
    for name in made:
        delete_vhost(management, name)


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
    delete_vhost(management, settings.vhost)


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
