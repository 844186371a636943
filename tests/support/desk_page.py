"""Driving the failure desk's page the way an operator does (test-only): the elements the page
gives ids and classes to, reached through clicks and typing, never through its internals."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select

from rabbit_retry.settings import Settings

from .browser import render_count, until, view_loaded
from .desk import Desk
from .parked import Parked, park
from .poll import wait_for
from .provision import provision_sync

# One classic queue whose messages stay put (a 1 h retry): the page's tests park into it.
ORDERS = """
version: 1
defaults:
  queue_type: classic
  retry: {delays: [1h], max_attempts: 3}
queues:
  orders: {}
"""


def topology_file(settings: Settings, workdir: Path, text: str = ORDERS) -> Path:
    """``text`` declared on ``settings``' vhost and written to a file for the desk."""
    provision_sync(settings, text)
    path = workdir / "desk-test.yml"
    path.write_text(text)
    return path


def park_and_wait(settings: Settings, desk: Desk, queue: str, messages: list[Parked]) -> None:
    """Parks ``messages`` on ``queue`` and waits until the desk has stored them all."""
    before = desk.get("/api/messages", queue=queue, status="parked", limit=1)["total"]
    asyncio.run(park(settings, queue, messages))
    wait_for(lambda: desk.get("/api/messages", queue=queue, status="parked", limit=1)["total"]
             >= before + len(messages), f"the desk to store {len(messages)} parked on {queue}",
             unless=desk.died)


def open_desk(driver: webdriver.Chrome, desk: Desk, *, name: str | None = None,
              secret: str | None = None, signed_in_as: str = "loopback") -> None:
    """Opens the page (logging in with ``name`` and ``secret``, or the token alone, when
    given) and waits for the overview, signed in as ``signed_in_as``."""
    driver.get(desk.url + "/")
    if secret is not None:
        log_in(driver, name, secret)
    until(driver, lambda d: d.find_element(By.ID, "who-name").text == signed_in_as,
          f"the page to say it is {signed_in_as}")
    view_loaded(driver, "overview")


def log_in(driver: webdriver.Chrome, name: str | None, secret: str) -> None:
    """Fills the login form (the name only when it asks for one) and sends it."""
    field = until(driver, lambda d: _shown(d, "secret"), "the login form")
    if name is not None:
        until(driver, lambda d: _shown(d, "name"), "the login form's name field").send_keys(name)
    field.send_keys(secret)
    field.submit()


def _shown(driver: webdriver.Chrome, element_id: str) -> WebElement | None:
    found = driver.find_elements(By.ID, element_id)
    return found[0] if found and found[0].is_displayed() else None


def go(driver: webdriver.Chrome, view: str) -> WebElement:
    """Clicks ``view`` in the navigation; the view once rendered."""
    since = render_count(driver)
    driver.find_element(By.CSS_SELECTOR, f'nav a[data-view="{view}"]').click()
    return view_loaded(driver, view, since)


def follow(driver: webdriver.Chrome, element: WebElement, view: str) -> WebElement:
    """Clicks a link that leads to ``view``; the view once rendered."""
    since = render_count(driver)
    element.click()
    return view_loaded(driver, view, since)


def rows(driver: webdriver.Chrome, table_id: str) -> list[WebElement]:
    return driver.find_elements(By.CSS_SELECTOR, f"#{table_id} tbody tr")


def group_row(driver: webdriver.Chrome, exception_type: str) -> WebElement:
    """The groups view's row of the group that failed with ``exception_type``."""
    found = [r for r in rows(driver, "groups")
             if r.find_element(By.CSS_SELECTOR, ".exception .type").text == exception_type]
    assert len(found) == 1, f"{len(found)} groups of {exception_type}"
    return found[0]


def dialog(driver: webdriver.Chrome) -> WebElement:
    return until(driver, lambda d: _shown(d, "action-dialog"), "the confirmation dialog")


def confirm(driver: webdriver.Chrome, expect: str) -> str:
    """Confirms the open dialog and waits for the page's notice starting with ``expect``."""
    since = render_count(driver)
    driver.find_element(By.ID, "action-confirm").click()

    def outcome(d: webdriver.Chrome) -> tuple[str, str] | None:
        if urlsplit(d.current_url).path != "/":
            return "left the page for", d.current_url
        if (refused := error_line(d, "action-error")) is not None:
            return "refused", refused
        notice = _shown(d, "notice")
        return ("done", notice.text) if notice and notice.text.startswith(expect) else None

    kind, notice = until(driver, outcome, f"a notice starting {expect!r}")
    assert kind == "done", f"{kind}: {notice}"
    until(driver, lambda d: render_count(d) > since, "the view to show the change")
    until(driver, lambda d: not d.find_element(By.ID, "action-dialog").is_displayed(),
          "the dialog to close")
    return notice


def replay_options(driver: webdriver.Chrome, to: str | None = None,
                   rate: int | None = None) -> None:
    if to is not None:
        Select(driver.find_element(By.ID, "replay-to")).select_by_value(to)
    if rate is not None:
        driver.find_element(By.ID, "replay-rate").send_keys(str(rate))


def error_line(driver: webdriver.Chrome, element_id: str) -> str | None:
    shown = _shown(driver, element_id)
    return shown.text if shown else None
