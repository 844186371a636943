"""The failure desk's page in a real browser: headless Chromium (the system's) against a real
``rabbit-retry desk`` process, its store and a throwaway vhost on the broker under test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from support.browser import chrome, console
from support.report import Section, on_failure


@pytest.fixture
def browser(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """A fresh headless Chromium (nothing stored from another test). When the test failed, its
    last screen and console are saved beside its temporary files and named in the report."""
    driver = chrome()

    def last_screen() -> list[Section]:
        shot = tmp_path / "failed.png"
        driver.save_screenshot(str(shot))
        lines = "\n".join(str(entry) for entry in console(driver))
        return [("browser", f"screen: {shot}\nconsole:\n{lines}")]

    on_failure(request.node, last_screen)
    try:
        yield driver
    finally:
        driver.quit()
