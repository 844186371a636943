"""The failure desk's page beyond replay and discard, in headless Chromium against a real desk:
edit and replay a message and follow its history, restore a discarded one, follow a long
replay's progress and cancel it, notes on a group and a grouping rule, and what a viewer is
offered (nothing to act with). What the page shows is checked against the broker and the API."""

from __future__ import annotations

from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from support.amqp import depth_sync, drain_sync
from support.browser import render_count, screenshot, until, view_loaded
from support.desk import ACCESS, SECRETS, running_desk
from support.desk_page import (
    confirm,
    dialog,
    follow,
    go,
    open_desk,
    park_and_wait,
    replay_options,
    rows,
    topology_file,
)
from support.parked import Parked
from support.poll import wait_for

from rabbit_retry.settings import Settings


def _open_message(browser: webdriver.Chrome, message_id: str) -> None:
    go(browser, "messages")
    row = next(r for r in rows(browser, "messages")
               if r.find_element(By.CSS_SELECTOR, "a.open").text == message_id)
    follow(browser, row.find_element(By.CSS_SELECTOR, "a.open"), "message")


def test_edit_and_replay_a_message_follow_its_history_and_restore_another(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path, access=ACCESS) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            Parked(b'{"sku": "old-sku", "qty": 2}', message_id="e-1",
                   properties={"correlation_id": "cart-77"}, headers={"tenant": "acme"}),
            Parked(b'{"sku": "x"}', message_id="r-1"),
        ])
        open_desk(browser, desk, name="ana", secret=SECRETS["ana"], signed_in_as="ana")

        # Edit the body, replay the edited copy: the parked one is kept as it was.
        _open_message(browser, "e-1")
        assert "cart-77" in browser.find_element(By.CSS_SELECTOR, "dl.summary").text
        browser.find_element(By.ID, "edit-message").click()
        dialog(browser)
        body = browser.find_element(By.ID, "edit-body")
        assert body.get_attribute("value") == '{"sku": "old-sku", "qty": 2}'
        body.clear()
        body.send_keys('{"sku": "new-sku", "qty": 2}')
        browser.find_element(By.ID, "edit-reason").send_keys("sku renamed upstream")
        screenshot(browser, "edit")
        confirm(browser, "Replayed 1 message")
        wait_for(lambda: depth_sync(fresh_vhost, "orders") == 1, "the edited copy in orders",
                 unless=desk.died)
        [copy] = drain_sync(fresh_vhost, "orders")
        assert copy.body == b'{"sku": "new-sku", "qty": 2}'
        assert copy.properties.headers["replay-edited"] is True
        view = view_loaded(browser, "message")
        assert "replayed" in view.find_element(By.CSS_SELECTOR, ".status").text
        assert '"old-sku"' in browser.find_element(By.ID, "message-body").text  # kept
        events = [r.get_attribute("data-event") for r in rows(browser, "history")]
        assert events == ["parked", "edited and replayed"]
        edited = rows(browser, "history")[1].text
        assert "by ana to orders" in edited
        browser.find_element(By.CSS_SELECTOR, "#history details summary").click()
        assert '+{"sku": "new-sku", "qty": 2}' in browser.find_element(
            By.CSS_SELECTOR, "#history pre.diff").text
        screenshot(browser, "history")

        # Discard the other one, then restore it from the discarded list.
        _open_message(browser, "r-1")
        browser.find_element(By.ID, "discard-message").click()
        dialog(browser)
        browser.find_element(By.ID, "discard-reason").send_keys("thought it was junk")
        confirm(browser, "Discarded 1 message.")
        since = render_count(browser)
        browser.get(desk.url + "/#/messages?status=discarded")
        view_loaded(browser, "messages", since)
        until(browser, lambda d: len(rows(d, "messages")) == 1, "one discarded message")
        rows(browser, "messages")[0].find_element(By.CSS_SELECTOR, "input.select").click()
        browser.find_element(By.ID, "restore-selected").click()
        assert "1 selected message" in dialog(browser).text
        confirm(browser, "Restored 1 message")
        [restored] = desk.get("/api/messages", q="r-1")["items"]
        assert restored["status"] == "parked"
        history = [e["event"] for e in desk.get(f"/api/messages/{restored['id']}/history")
                   ["events"]]
        assert history == ["parked", "discarded", "restored"]

        # The audit says who did each, with the edit's change.
        go(browser, "audit")
        actions = [r.get_attribute("data-action") for r in rows(browser, "audit")]
        assert actions == ["restore", "discard", "edit"]
        edit_row = rows(browser, "audit")[2]
        assert edit_row.find_element(By.CSS_SELECTOR, "td.actor").text == "ana"
        assert "sku renamed upstream" in edit_row.text


def test_a_long_replay_shows_its_progress_and_is_cancelled_from_the_page(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    n = 400
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path, access=ACCESS) as desk:
        park_and_wait(fresh_vhost, desk, "orders",
                      [Parked(b"{}", message_id=f"p-{i:03d}") for i in range(n)])
        open_desk(browser, desk, name="ana", secret=SECRETS["ana"], signed_in_as="ana")
        go(browser, "groups")
        rows(browser, "groups")[0].find_element(By.CSS_SELECTOR, "button.replay").click()
        dialog(browser)
        replay_options(browser, rate=20)
        browser.find_element(By.ID, "action-confirm").click()

        # Running: blue, not green; done of total, rate, time left.
        state = until(browser, lambda d: d.find_elements(By.ID, "replay-state"),
                      "the replay's progress")[0]
        assert "state-running" in state.get_attribute("class")
        line = until(browser, lambda d: d.find_element(By.ID, "replay-progress").text
                     if " a second" in d.find_element(By.ID, "replay-progress").text else None,
                     "a rate in the progress line")
        assert f"of {n} replayed" in line and "left" in line, line
        screenshot(browser, "progress")
        browser.find_element(By.ID, "replay-cancel").click()
        until(browser, lambda d: "state-cancelled" in d.find_element(
            By.ID, "replay-state").get_attribute("class"), "the replay cancelled")
        final = browser.find_element(By.ID, "replay-progress").text
        browser.find_element(By.ID, "action-cancel").click()  # Close
        notice = until(browser, lambda d: d.find_element(By.ID, "notice").text
                       if d.find_element(By.ID, "notice").is_displayed() else None,
                       "the notice")
        assert notice.startswith("Replay ") and "cancelled after" in notice, notice

        # The page and the API agree, and so does the broker.
        [entry] = desk.get("/api/audit")
        done = entry["progress"]["done"]
        assert (entry["state"], entry["cancelled_by"]) == ("cancelled", "ana")
        assert final.startswith(f"{done} of {n} replayed"), final
        assert 0 < done < n
        wait_for(lambda: depth_sync(fresh_vhost, "orders") == done, f"{done} in orders")
        assert desk.get("/api/messages", status="parked", limit=1)["total"] == n - done


def test_notes_and_a_grouping_rule_from_the_page(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path, access=ACCESS) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            Parked(b"{}", message_id=f"q-{i}", exception_type="QuotaError",
                   headers={"exception-message": f"tenant {name} over quota"})
            for i, name in enumerate(["acme", "zeta", "omni"])])
        open_desk(browser, desk, name="ana", secret=SECRETS["ana"], signed_in_as="ana")
        go(browser, "groups")
        assert len(rows(browser, "groups")) == 3
        browser.find_element(By.CSS_SELECTOR, "#rules summary").click()
        browser.find_element(By.ID, "rule-pattern").send_keys(r"tenant \w+")
        browser.find_element(By.ID, "rule-name").send_keys("tenant")
        since = render_count(browser)
        browser.find_element(By.CSS_SELECTOR, "#rule-form button").click()
        view_loaded(browser, "groups", since)
        wait_for(lambda: len(desk.get("/api/groups")) == 1, "the three in one group")
        go(browser, "groups")
        [row] = rows(browser, "groups")
        assert "<tenant> over quota" in row.text
        assert "tenant \\w+" in browser.find_element(By.ID, "rules-table").text

        follow(browser, row.find_element(By.CSS_SELECTOR, "a.cause"), "group")
        browser.find_element(By.ID, "note-text").send_keys("billing is on it (ticket 4411)")
        since = render_count(browser)
        browser.find_element(By.CSS_SELECTOR, "#note-form button").click()
        view_loaded(browser, "group", since)
        note = browser.find_element(By.CSS_SELECTOR, "#notes .note")
        assert "ana" in note.text and "billing is on it (ticket 4411)" in note.text
        screenshot(browser, "group")
        assert [n["text"] for n in desk.get(f"/api/groups/{desk.get('/api/groups')[0]['id']}")
                ["notes"]] == ["billing is on it (ticket 4411)"]


def test_a_viewer_reads_everything_and_is_offered_no_action(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path, access=ACCESS) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [Parked(b"{}", message_id="v-1")])
        open_desk(browser, desk, name="vic", secret=SECRETS["vic"], signed_in_as="vic")
        assert browser.find_element(By.ID, "who-role").text == "viewer"
        go(browser, "groups")
        [row] = rows(browser, "groups")
        assert row.find_elements(By.CSS_SELECTOR, "button") == []
        go(browser, "messages")
        assert browser.find_elements(By.ID, "replay-selected") == []
        assert browser.find_elements(By.CSS_SELECTOR, "input.select") == []
        _open_message(browser, "v-1")
        assert browser.find_elements(By.CSS_SELECTOR, ".toolbar button") == []
        # The control: the same message offers ana her actions.
        browser.find_element(By.ID, "logout").click()
        until(browser, lambda d: d.current_url.endswith("/login"), "the login page")
        open_desk(browser, desk, name="ana", secret=SECRETS["ana"], signed_in_as="ana")
        _open_message(browser, "v-1")
        assert len(browser.find_elements(By.CSS_SELECTOR, ".toolbar button")) == 3
