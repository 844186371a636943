"""The worker decision cases of ``support.worker_cases`` on the in-memory broker, as each
RabbitMQ version behaves (tests/integration/test_worker_cases_on_rabbitmq.py runs the same cases
on the real broker)."""

from __future__ import annotations

import pytest
from support.worker_cases import InMemory, WorkerCases


class TestWorkerInMemory(WorkerCases):
    @pytest.fixture(params=["3.10", "4.0", "4.3"])
    def env(self, request: pytest.FixtureRequest) -> InMemory:
        return InMemory(request.param)
