"""Headless Chromium through Selenium for the failure desk page's tests (test-only).

The browser is the system's (Debian's ``chromium`` and ``chromium-driver``, which
scripts/test.sh installs): missing, a test fails in CI and skips elsewhere. Selenium is given
both paths, so it never looks for, or downloads, a browser or driver of its own.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from .poll import DEADLINE_S
from .tools import require

T = TypeVar("T")

BROWSERS = ("chromium", "chromium-browser")
INSTALL = "apt-get install chromium chromium-driver"
# Set to a directory to save the views the tests pass through as PNGs (docs/images does so).
SCREENSHOTS_ENV = "RABBIT_RETRY_DESK_SCREENSHOTS"


def chrome() -> webdriver.Chrome:
    """A new headless Chromium, 1400x900, its console kept for ``console()``."""
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    if browser is None:
        browser = require(BROWSERS[0], installed_by=INSTALL)
    driver_path = require("chromedriver", installed_by=INSTALL)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,900", "--lang=en-GB",
                     "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    # The console for console(), the network for sent(): what the page itself sends.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    os.environ.setdefault("SE_AVOID_STATS", "true")
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def until(driver: webdriver.Chrome, check: Callable[[webdriver.Chrome], T], what: str,
          within: float = DEADLINE_S) -> T:
    """Poll ``check(driver)`` until it is truthy; fail naming ``what`` (a deadline, not a
    statement about speed)."""
    return WebDriverWait(driver, within, poll_frequency=0.1).until(  # type: ignore[no-any-return]
        check, message=f"gave up after {within:g}s waiting for {what}")


def view_loaded(driver: webdriver.Chrome, name: str, since: int = 0) -> WebElement:
    """The page's ``#view`` once view ``name`` has finished rendering (a render newer than
    ``since``, as ``#view[data-loaded]`` counts them)."""

    def loaded(d: webdriver.Chrome) -> WebElement | None:
        view = d.find_element(By.ID, "view")
        done = (view.get_attribute("data-view") == name
                and view.get_attribute("aria-busy") == "false"
                and int(view.get_attribute("data-loaded") or 0) > since)
        return view if done else None

    return until(driver, loaded, f"the {name} view")


def render_count(driver: webdriver.Chrome) -> int:
    return int(driver.find_element(By.ID, "view").get_attribute("data-loaded") or 0)


def alert_text(driver: webdriver.Chrome) -> str | None:
    """The text of an open alert() / confirm() dialog, or None when there is none."""
    try:
        return driver.switch_to.alert.text
    except NoAlertPresentException:
        return None


def console(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    """The browser console's entries since the last call."""
    return list(driver.get_log("browser"))


def sent(driver: webdriver.Chrome, method: str) -> list[tuple[str, dict[str, str]]]:
    """(path, headers) of every ``method`` request the page sent since the last call, read from
    Chromium's network log: what left the page, with the headers the page set."""
    found = []
    for entry in driver.get_log("performance"):
        event = json.loads(entry["message"])["message"]
        if event.get("method") != "Network.requestWillBeSent":
            continue
        request = event["params"]["request"]
        if request["method"] == method:
            path = "/" + request["url"].split("://", 1)[1].split("/", 1)[1].split("?", 1)[0]
            found.append((path, {k.lower(): v for k, v in request["headers"].items()}))
    return found


def screenshot(driver: webdriver.Chrome, name: str) -> None:
    """Saves the window as ``desk-NAME.png`` in $RABBIT_RETRY_DESK_SCREENSHOTS, when set."""
    directory = os.environ.get(SCREENSHOTS_ENV)
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        driver.execute_script("window.scrollTo(0, 0)")
        assert driver.save_screenshot(str(Path(directory) / f"desk-{name}.png"))
