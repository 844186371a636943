"""The worker decision cases of ``support.worker_cases`` on the real broker under test: the same
cases pass on ``rabbit_retry.testing``'s in-memory broker (tests/unit/
test_worker_cases_in_memory.py), so it is faithful where the worker's decisions depend on it."""

from __future__ import annotations

import pytest
from support.worker_cases import OnRabbitMQ, WorkerCases

from rabbit_retry.broker.management import Management
from rabbit_retry.settings import Settings
from rabbit_retry.worker.redelivery import counting


class TestWorkerOnRabbitMQ(WorkerCases):
    @pytest.fixture
    def env(self, fresh_vhost: Settings, management: Management) -> OnRabbitMQ:
        version = counting(management.overview()["rabbitmq_version"]).label
        return OnRabbitMQ(fresh_vhost, version)
