"""The failure desk's page, as an operator uses it, in headless Chromium against a real desk:
find why messages parked, replay one group to another queue, discard another with a reason, see
who did it in the audit; search and page through messages and act on a selection.

What the page shows is checked against what the broker and the desk's own API say, never
against the page alone."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from selenium import webdriver
from selenium.webdriver.common.by import By
from support.amqp import depth_sync, drain_sync
from support.browser import console, screenshot, sent, until, view_loaded
from support.desk import ACCESS, SECRETS, running_desk
from support.desk_page import (
    ORDERS,
    confirm,
    dialog,
    error_line,
    follow,
    go,
    group_row,
    open_desk,
    park_and_wait,
    replay_options,
    rows,
    topology_file,
)
from support.parked import Parked
from support.poll import wait_for

from rabbit_retry.settings import Settings

DASH = "\N{EN DASH}"  # the page writes a range of rows as 1<EN DASH>50 of 120
TOPOLOGY = ORDERS + """\
  email: {}
  orders-manual: {}
"""


def _failed(exception_type: str, message: str, body: bytes, message_id: str,
            reason: str = "exhausted", **headers: object) -> Parked:
    return Parked(body, exception_type=exception_type, reason=reason, message_id=message_id,
                  headers={"exception-message": message, **headers})


def test_find_the_cause_replay_one_group_discard_another_and_the_audit_says_who(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path, TOPOLOGY)
    with running_desk(fresh_vhost, topology, tmp_path, access=ACCESS) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            *(_failed("TimeoutError", f"payment gateway timed out after {30 + i}s",
                      b'{"order_id": %d, "amount_cents": 1250}' % i, f"pay-{i}")
              for i in range(5)),
            *(_failed("KeyError", "'sku'", b'{"order_id": %d}' % i, f"sku-{i}", "permanent")
              for i in range(3)),
        ])
        park_and_wait(fresh_vhost, desk, "email", [
            _failed("SMTPRecipientsRefused", f"mailbox full: user{i}@example.com",
                    b'{"to": "user%d@example.com"}' % i, f"mail-{i}") for i in range(4)
        ])

        # The overview: how much is parked, where and why; ana signed in with her own secret.
        open_desk(browser, desk, name="ana", secret=SECRETS["ana"], signed_in_as="ana")
        assert browser.find_element(By.ID, "who-role").text == "operator"
        assert browser.find_element(By.ID, "logout").is_displayed()
        assert not browser.find_element(By.ID, "auth-banner").is_displayed()
        assert browser.find_element(By.CSS_SELECTOR, "#card-parked .value").text == "12"
        by_queue = {r.get_attribute("data-queue"): r for r in rows(browser, "overview-queues")}
        assert by_queue["orders"].find_element(By.CSS_SELECTOR, "td.num").text == "8"
        assert by_queue["email"].find_element(By.CSS_SELECTOR, "td.num").text == "4"
        assert {c.text for c in by_queue["orders"].find_elements(By.CSS_SELECTOR, ".chip")} == {
            "exhausted 5", "permanent 3"}
        screenshot(browser, "overview")

        # Why they parked: one group per cause, whatever varied from message to message.
        go(browser, "groups")
        assert len(rows(browser, "groups")) == 3
        timeouts = group_row(browser, "TimeoutError")
        assert timeouts.find_element(By.CSS_SELECTOR, "a.count").text == "5"
        assert "payment gateway timed out" in timeouts.find_element(
            By.CSS_SELECTOR, ".exception .message").text
        assert group_row(browser, "KeyError").find_element(By.CSS_SELECTOR, "a.count").text == "3"
        screenshot(browser, "groups")

        # The group's messages, and one of them in full.
        follow(browser, timeouts.find_element(By.CSS_SELECTOR, "a.count"), "messages")
        listed = rows(browser, "messages")
        assert sorted(r.find_element(By.CSS_SELECTOR, "a.open").text for r in listed) == [
            f"pay-{i}" for i in range(5)]
        follow(browser, listed[0].find_element(By.CSS_SELECTOR, "a.open"), "message")
        shown_id = browser.find_element(By.ID, "message-id").text
        i = int(shown_id.removeprefix("pay-"))
        assert f'"order_id": {i}' in browser.find_element(By.ID, "message-body").text
        headers = browser.find_element(By.ID, "message-headers").text
        assert "exception-type" in headers and "TimeoutError" in headers
        assert f"payment gateway timed out after {30 + i}s" in browser.find_element(
            By.ID, "message-exception").text
        screenshot(browser, "message")
        follow(browser, browser.find_element(By.CSS_SELECTOR, "a.back"), "messages")
        assert len(rows(browser, "messages")) == 5  # back to the group's list, not every message

        # Replay the timeouts to another queue of the topology, at a rate.
        go(browser, "groups")
        group_row(browser, "TimeoutError").find_element(By.CSS_SELECTOR, "button.replay").click()
        assert "5 parked messages" in dialog(browser).text
        replay_options(browser, to="orders-manual", rate=50)
        screenshot(browser, "replay")
        notice = confirm(browser, "Replayed 5 messages")
        replay_id = re.fullmatch(r"Replayed 5 messages \(replay (\S+)\)\.", notice)
        assert replay_id, notice
        wait_for(lambda: depth_sync(fresh_vhost, "orders-manual") == 5,
                 "the 5 replayed messages in orders-manual", unless=desk.died)
        assert sorted(m.message_id for m in drain_sync(fresh_vhost, "orders-manual")) == [
            f"pay-{i}" for i in range(5)]
        assert depth_sync(fresh_vhost, "orders") == 0

        # Cancel changes nothing; a blank reason is refused in one line; then a discard.
        audit_before = desk.get("/api/audit")
        go(browser, "groups")
        group_row(browser, "KeyError").find_element(By.CSS_SELECTOR, "button.discard").click()
        dialog(browser)
        browser.find_element(By.ID, "action-cancel").click()
        until(browser, lambda d: not d.find_element(By.ID, "action-dialog").is_displayed(),
              "the dialog to close")
        group_row(browser, "SMTPRecipientsRefused").find_element(
            By.CSS_SELECTOR, "button.discard").click()
        dialog(browser)
        browser.find_element(By.ID, "discard-reason").send_keys("   ")
        browser.find_element(By.ID, "action-confirm").click()
        assert until(browser, lambda d: error_line(d, "action-error"), "the blank reason's error"
                     ) == "say why: the reason is recorded in the audit"
        assert desk.get("/api/audit") == audit_before  # nothing was asked of the desk
        browser.find_element(By.ID, "discard-reason").send_keys("mailboxes full; customers called")
        screenshot(browser, "discard")
        confirm(browser, "Discarded 4 messages")
        wait_for(lambda: [g["exception_type"] for g in desk.get("/api/groups", status="parked")]
                 == ["KeyError"], "only the KeyError group still parked", unless=desk.died)
        assert desk.get("/api/messages", queue="orders", status="parked", limit=1)["total"] == 3

        # The audit says who did what, to how many, why, and the replay's id.
        go(browser, "audit")
        entries = {r.find_element(By.CSS_SELECTOR, ".action").text: r
                   for r in rows(browser, "audit")}
        assert sorted(entries) == ["discard", "replay"]
        replay_cells = [c.text for c in entries["replay"].find_elements(By.TAG_NAME, "td")]
        assert replay_cells[1:4] == ["ana", "replay", "5"]
        assert replay_cells[4].endswith("\N{RIGHTWARDS ARROW} orders-manual")
        assert replay_cells[6] == replay_id.group(1)
        assert replay_cells[7].startswith("done 5 replayed"), replay_cells[7]
        assert "0 parked again" in replay_cells[7]
        discard_cells = [c.text for c in entries["discard"].find_elements(By.TAG_NAME, "td")]
        assert discard_cells[1:4] == ["ana", "discard", "4"]
        assert discard_cells[5] == "mailboxes full; customers called"
        screenshot(browser, "audit")
        audit = desk.get("/api/audit")
        assert sorted((e["actor"], e["action"], e["count"]) for e in audit) == [
            ("ana", "discard", 4), ("ana", "replay", 5)]

        # Nothing went wrong in the page along the way.
        assert [e for e in console(browser) if e["level"] == "SEVERE"] == []

        # The page named no operator of its own: the desk knew who was signed in.
        posts = [(p, h) for p, h in sent(browser, "POST") if p.startswith("/api/")]
        assert [path for path, _ in posts] == ["/api/replay", "/api/discard"]
        for _, headers in posts:
            assert "x-actor" not in headers
            assert headers["content-type"] == "application/json"
            assert headers["x-csrf-token"]


def test_search_pages_and_a_selection_across_pages(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path, TOPOLOGY)
    total = 120
    with running_desk(fresh_vhost, topology, tmp_path) as desk:
        messages = [
            Parked(b'{"sku": "sku-%03d", "note": "plain"}' % i, message_id=f"m-{i:03d}",
                   properties={"correlation_id": f"corr-{i:03d}"},
                   headers={"exception-message": "stock service returned 503",
                            "tenant": f"tenant-{i % 4}"})
            for i in range(total)
        ]
        messages[77] = Parked(b'{"sku": "sku-077", "note": "the needle-in-the-body"}',
                              message_id="m-077",
                              properties={"correlation_id": "needle-correlation"},
                              headers={"exception-message": "stock service returned 503",
                                       "customer-ref": "needle-header"})
        park_and_wait(fresh_vhost, desk, "orders", messages)
        open_desk(browser, desk)

        # Search by message id, correlation id, a header's value (NAME=VALUE), the body's text.
        view = go(browser, "messages")
        for text in ("m-077", "needle-correlation", "customer-ref=needle-header",
                     "needle-in-the-body"):
            box = view.find_element(By.ID, "messages-q")
            box.clear()
            box.send_keys(text)
            view = follow(browser, view.find_element(By.CSS_SELECTOR,
                                                     "#messages-filter button"), "messages")
            found = [r.find_element(By.CSS_SELECTOR, "a.open").text
                     for r in rows(browser, "messages")]
            assert found == ["m-077"], (text, found)
            assert browser.find_element(By.ID, "page-range").text == f"1{DASH}1 of 1"

        # Paging: 50 rows at a time, never all of them, each page different.
        go(browser, "messages")
        seen: list[str] = []
        for expected in (f"1{DASH}50 of 120", f"51{DASH}100 of 120", f"101{DASH}120 of 120"):
            assert browser.find_element(By.ID, "page-range").text == expected
            page = [r.find_element(By.CSS_SELECTOR, "a.open").text
                    for r in rows(browser, "messages")]
            assert 0 < len(page) <= 50
            seen += page
            nexts = browser.find_elements(By.ID, "page-next")
            if expected.startswith("101"):
                assert nexts == []
                break
            follow(browser, nexts[0], "messages")
        assert sorted(seen) == [f"m-{i:03d}" for i in range(total)]
        # Each page was one request for one page: a limit on every request, never everything.
        pages = [parse_qs(urlsplit(u).query) for u in _message_queries(browser)]
        assert all(p["limit"] == ["50"] for p in pages), pages
        assert {p.get("offset", ["0"])[0] for p in pages} >= {"50", "100"}

        # A selection kept across pages: two on the last page, one on the first.
        boxes = [r.find_element(By.CSS_SELECTOR, "input.select") for r in rows(browser, "messages")]
        picked = [r.find_element(By.CSS_SELECTOR, "a.open").text
                  for r in rows(browser, "messages")][:2]
        boxes[0].click()
        boxes[1].click()
        follow(browser, browser.find_element(By.ID, "page-first"), "messages")
        first = rows(browser, "messages")[0]
        first.find_element(By.CSS_SELECTOR, "input.select").click()
        picked.append(first.find_element(By.CSS_SELECTOR, "a.open").text)
        assert browser.find_element(By.ID, "selected-count").text == "3 selected"
        screenshot(browser, "messages")
        browser.find_element(By.ID, "replay-selected").click()
        assert "3 selected messages of queue orders" in dialog(browser).text
        confirm(browser, "Replayed 3 messages")
        wait_for(lambda: depth_sync(fresh_vhost, "orders") == 3, "3 replayed messages in orders",
                 unless=desk.died)
        assert sorted(m.message_id for m in drain_sync(fresh_vhost, "orders")) == sorted(picked)
        assert desk.get("/api/messages", status="parked", limit=1)["total"] == total - 3
        assert browser.find_element(By.ID, "selected-count").text == "none selected"


def _message_queries(driver: webdriver.Chrome) -> list[str]:
    """The /api/messages addresses the page asked for, from the browser's own record."""
    names = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
        ".filter(n => n.includes('/api/messages?'))")
    return [str(n) for n in names]


def test_the_view_names_the_desk_s_reason_when_it_refuses(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """A message that is not there: the desk's 404 reaches the operator as one line."""
    topology = topology_file(fresh_vhost, tmp_path, TOPOLOGY)
    with running_desk(fresh_vhost, topology, tmp_path) as desk:
        open_desk(browser, desk)
        response = desk.api("GET", "/api/messages/999999")
        assert response.status_code == 404
        browser.get(desk.url + "/#/message/999999")
        view_loaded(browser, "message")
        line = until(browser, lambda d: error_line(d, "error"), "the error line")
        assert line.startswith("404: ")
        assert "\n" not in line


def test_a_body_that_is_not_text_is_shown_as_base64(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    body = b"\x00\xff\xfe not UTF-8 \x80"
    topology = topology_file(fresh_vhost, tmp_path, TOPOLOGY)
    with running_desk(fresh_vhost, topology, tmp_path) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [Parked(body, message_id="binary-1")])
        open_desk(browser, desk)
        go(browser, "messages")
        [row] = rows(browser, "messages")
        follow(browser, row.find_element(By.CSS_SELECTOR, "a.open"), "message")
        assert "Body (binary, base64)" in browser.find_element(By.ID, "view").text
        shown = browser.find_element(By.ID, "message-body").text
        assert base64.b64decode(shown) == body
