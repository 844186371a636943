"""The page at 1,024 px and with long values, and times that say their zone (issue 22): every
action of a row stays on screen, a long reason wraps instead of pushing the audit off screen."""

from __future__ import annotations

from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from support.desk import running_desk
from support.desk_page import follow, go, open_desk, park_and_wait, rows, topology_file
from support.parked import Parked

from rabbit_retry.settings import Settings

LONG_URL = "https://example.com/" + "very-long-path-segment/" * 12 + "?" + "a=1&" * 30


def _fits(driver: webdriver.Chrome) -> None:
    """Nothing on the page reaches past the window's right edge."""
    overflow = driver.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, f"the page is {overflow}px wider than the window"


def test_at_1024_px_with_long_values_every_action_stays_on_screen(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    browser.set_window_size(1024, 800)
    width = browser.execute_script("return document.documentElement.clientWidth")
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            Parked(b"{}", exception_type="requests.exceptions.ConnectionError" * 2,
                   message_id="m-" + "x" * 120,
                   headers={"exception-message": f"cannot reach {LONG_URL} (api)"}),
            Parked(b"{}", exception_type="KeyError", message_id="m-2",
                   headers={"exception-message": "'sku'"}),
        ])
        desk.api("POST", "/api/discard", json={"ids": [2], "reason": f"see {LONG_URL}"})
        open_desk(browser, desk)
        for view in ("groups", "messages", "audit"):
            go(browser, view)
            _fits(browser)
        # One message with its long id, URL and type, and its history.
        go(browser, "messages")
        long_one = next(r for r in rows(browser, "messages") if "m-xxxx" in r.text)
        follow(browser, long_one.find_element(By.CSS_SELECTOR, "a.open"), "message")
        _fits(browser)
        go(browser, "groups")
        for row in rows(browser, "groups"):
            for button in row.find_elements(By.CSS_SELECTOR, "button"):
                right = browser.execute_script(
                    "return arguments[0].getBoundingClientRect().right", button)
                assert right <= width, f"{button.text} ends at {right}px of {width}"


def test_times_say_their_zone(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            Parked(b"{}", message_id="m-1", parked_at="2026-11-02T10:00:00+00:00")])
        open_desk(browser, desk)
        go(browser, "messages")
        [row] = rows(browser, "messages")
        shown = row.find_element(By.TAG_NAME, "time").text
        assert shown == "2026-11-02 10:00:00 UTC", shown
