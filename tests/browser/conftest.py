"""The failure desk's page in a real browser: headless Chromium (the system's) against a real
``rabbit-retry desk`` process, its store and a throwaway vhost on the broker under test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from support.browser import chrome, console


@pytest.fixture
def browser(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """A fresh headless Chromium (nothing stored from another test). When the test failed, its
    last screen and console are saved beside its temporary files and named in the report."""
    driver = chrome()
    try:
        yield driver
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            shot = tmp_path / "failed.png"
            driver.save_screenshot(str(shot))
            lines = "\n".join(str(entry) for entry in console(driver))
            report.sections.append(("browser", f"screen: {shot}\nconsole:\n{lines}"))
        driver.quit()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
