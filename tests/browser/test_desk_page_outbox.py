"""The desk's page with an application's outbox and an ordered queue, in headless Chromium
against a real ``rabbit-retry desk --outbox`` process: a dead outbox event shown beside the
parked messages (its hostile body and key as text), retried from the page (pending again, in
the audit; the relay publishes it), and the held keys naming the parked message holding each."""

from __future__ import annotations

import asyncio
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from support.amqp import depth_sync, drain_sync
from support.browser import alert_text, screenshot, view_loaded
from support.desk import running_desk
from support.desk_page import (
    confirm,
    dialog,
    follow,
    go,
    open_desk,
    park_and_wait,
    rows,
    topology_file,
)
from support.outbox import migrated, refused_events, relay_running, statuses
from support.parked import Parked
from support.poll import eventually

from rabbit_retry import contract
from rabbit_retry.settings import Settings

SHOP = """
version: 1
defaults:
  queue_type: classic
  retry: {delays: [1h], max_attempts: 3}
exchanges:
  shop: {type: topic}
queues:
  orders:
    bindings: [{exchange: shop, routing_key: "order.created"}]
"""
HOSTILE = '<img src=x onerror="alert(1)">'
REFUSED = "the broker nacked it: queue 'orders' is full (reject-publish)"


def test_a_dead_event_beside_parked_messages_is_retried_and_held_keys_are_shown(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path, SHOP)
    outbox = f"sqlite:///{tmp_path / 'app.db'}"
    migrated(outbox)
    ids = refused_events(outbox, topology, reason=REFUSED, dead={
        "lost-1": {"exchange": "shop", "routing_key": "order.created", "key": HOSTILE,
                   "body": HOSTILE, "headers": {"tenant": "</script><script>alert(2)</script>"}}})
    assert statuses(outbox) == {"dead": 1}
    with running_desk(fresh_vhost, topology, tmp_path, outbox=outbox) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            Parked(b'{"points": 5}', message_id="holder-1",
                   headers={contract.ORDERED_HOLD: "hold-1", contract.ORDERED_KEY: "user-7"}),
            Parked(b'{"points": 1}', message_id="plain-1"),
        ])
        open_desk(browser, desk)
        assert "1" in browser.find_element(By.ID, "card-outbox").text
        assert browser.find_element(By.ID, "card-parked").text.splitlines()[1] == "2"

        # Beside the parked messages: the messages list, then the outbox, one tab apart.
        go(browser, "messages")
        assert {r.find_element(By.CSS_SELECTOR, "a.open").text for r in rows(browser, "messages")} \
            == {"holder-1", "plain-1"}
        holder = next(r for r in rows(browser, "messages") if "holder-1" in r.text)
        assert holder.find_element(By.CSS_SELECTOR, ".chip.holds-key").text == "holds key user-7"
        go(browser, "outbox")
        [row] = rows(browser, "outbox")
        assert row.get_attribute("data-status") == "dead"
        assert row.find_element(By.CSS_SELECTOR, "a.open").text == "lost-1"
        assert HOSTILE in row.text  # the key, as text
        assert REFUSED in row.text
        screenshot(browser, "outbox")
        follow(browser, row.find_element(By.CSS_SELECTOR, "a.open"), "outbox")
        assert browser.find_element(By.ID, "outbox-body").text == HOSTILE
        assert [r.find_elements(By.CSS_SELECTOR, "td")[1].text
                for r in rows(browser, "outbox-history")] == ["pending", "failed", "dead"]
        assert alert_text(browser) is None
        assert browser.find_elements(By.CSS_SELECTOR, "#view img") == []

        # Retry it from the list: pending again, and the relay publishes it (the desk does not);
        # the audit says who retried it.
        go(browser, "outbox")
        rows(browser, "outbox")[0].find_element(By.CSS_SELECTOR, "input.select").click()
        browser.find_element(By.ID, "outbox-retry-selected").click()
        assert "1 outbox event to shop" in dialog(browser).text
        browser.find_element(By.ID, "outbox-retry-reason").send_keys("bound order.lost now")
        confirm(browser, "Retried 1 outbox event")
        assert statuses(outbox) == {"pending": 1}
        assert depth_sync(fresh_vhost, "orders") == 0
        assert rows(browser, "outbox") == []
        asyncio.run(_relay_publishes(outbox, topology, fresh_vhost))
        [published] = drain_sync(fresh_vhost, "orders")
        assert (published.message_id, published.body) == ("lost-1", HOSTILE.encode())
        audit = desk.get("/api/audit")[0]
        assert (audit["action"], audit["actor"], audit["count"], audit["reason"],
                audit["selection"]["outbox_ids"]) == (
            "outbox-retry", "loopback", 1, "bound order.lost now", [ids["lost-1"]])
        go(browser, "audit")
        assert rows(browser, "audit")[0].get_attribute("data-action") == "outbox-retry"

        # Held keys: the key, and a link to the parked message holding it.
        go(browser, "held")
        [held] = rows(browser, "held")
        assert held.find_element(By.CSS_SELECTOR, "code.held-key").text == "user-7"
        follow(browser, held.find_element(By.CSS_SELECTOR, "a.open"), "message")
        assert "holder-1" in view_loaded(browser, "message").text
        assert alert_text(browser) is None


async def _relay_publishes(outbox: str, topology: Path, settings: Settings) -> None:
    async with relay_running(outbox, topology, settings):
        await eventually(lambda: statuses(outbox) == {"published": 1},
                         what="the relay to publish the retried event")
