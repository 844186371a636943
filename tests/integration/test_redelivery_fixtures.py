"""The broker under test still counts redeliveries as its fixture in tests/unit/fixtures says,
so the version rules unit-tested against those fixtures hold on a real broker."""

from __future__ import annotations

import json
from pathlib import Path

from support.deliveries import capture

from rabbit_retry.settings import Settings
from rabbit_retry.worker.redelivery import counting

FIXTURES = Path(__file__).parents[1] / "unit" / "fixtures"


async def test_the_broker_counts_redeliveries_as_its_fixture_says(fresh_vhost: Settings) -> None:
    seen = await capture(fresh_vhost.url)
    label = counting(seen["version"]).label
    path = FIXTURES / f"deliveries-{label}.json"
    assert path.exists(), (
        f"no fixture for RabbitMQ {seen['version']}: capture one with "
        f"`python tests/support/deliveries.py URL > {path.relative_to(Path.cwd())}`"
    )
    fixture = json.loads(path.read_text())
    assert seen["deliveries"] == fixture["deliveries"]
    assert seen["rejects"] == fixture["rejects"]
