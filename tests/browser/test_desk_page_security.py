"""The failure desk's page and what could attack it: a desk with a token lets no one in without
it and takes no action without the CSRF header; a message made to attack the page (in its
body, headers, ids and exception) is shown as text and runs nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from selenium import webdriver
from selenium.webdriver.common.by import By
from support.browser import alert_text, screenshot, sent, until, view_loaded
from support.desk import TOKEN, running_desk
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
from support.parked import Parked

from rabbit_retry.settings import Settings

CSRF_COOKIE = "rabbit_retry_csrf"

# A POST from inside the page, as a script injected there could send one: with the page's
# cookies, and with the CSRF header only when given. Calls back with the HTTP status.
FETCH = """
const [path, body, csrf, done] = arguments;
const headers = {"Content-Type": "application/json"};
if (csrf !== null) headers["X-CSRF-Token"] = csrf;
fetch(path, {method: "POST", headers, body: JSON.stringify(body), credentials: "same-origin"})
  .then(r => done(r.status), e => done(String(e)));
"""


def _post_from_page(driver: webdriver.Chrome, path: str, body: dict[str, Any],
                    csrf: str | None) -> Any:
    return driver.execute_async_script(FETCH, path, body, csrf)


def _path(driver: webdriver.Chrome) -> str:
    parts = urlsplit(driver.current_url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


def test_a_token_keeps_the_page_shut_and_every_action_carries_the_csrf_header(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path, token=TOKEN) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [
            Parked(b'{"n": %d}' % i, message_id=f"t-{i}") for i in range(3)])
        ids = {m["message_id"]: m["id"] for m in
               desk.get("/api/messages", queue="orders", status="parked")["items"]}
        unauthenticated = httpx.get(desk.url + "/api/overview", timeout=30)
        assert unauthenticated.status_code == 401
        assert set(unauthenticated.json()) == {"error"}

        # Not logged in: the page sends the browser to the login form.
        browser.get(desk.url + "/")
        until(browser, lambda d: _path(d) == "/login", "the login page")
        assert not browser.find_element(By.ID, "login-failed").is_displayed()
        screenshot(browser, "login")

        # A wrong token is refused, and says so (the token mode asks for no name).
        until(browser, lambda d: d.find_element(By.ID, "secret-label").text == "Token",
              "the token's login form")
        assert not browser.find_element(By.ID, "name").is_displayed()
        browser.find_element(By.ID, "secret").send_keys("not-the-token")
        browser.find_element(By.ID, "secret").submit()
        until(browser, lambda d: _path(d) == "/login?failed=1", "the refusal")
        assert browser.find_element(By.ID, "login-failed").is_displayed()
        assert _post_from_page(browser, "/api/discard",
                               {"ids": [ids["t-2"]], "reason": "x"}, None) == 401

        # The right one opens the desk, as "token" (the quick start names nobody); the
        # session cookie is out of scripts' reach.
        until(browser, lambda d: d.find_element(By.ID, "secret-label").text == "Token",
              "the token's login form")
        browser.find_element(By.ID, "secret").send_keys(TOKEN)
        browser.find_element(By.ID, "secret").submit()
        view_loaded(browser, "overview")
        until(browser, lambda d: d.find_element(By.ID, "who-name").text == "token",
              "the page to say who is signed in")
        until(browser, lambda d: d.find_element(By.ID, "logout").is_displayed(), "Log out")
        assert not browser.find_element(By.ID, "auth-banner").is_displayed()
        cookies = {c["name"]: c for c in browser.get_cookies()}
        assert CSRF_COOKIE in cookies and not cookies[CSRF_COOKIE]["httpOnly"]
        session = [c for n, c in cookies.items() if n != CSRF_COOKIE]
        assert session and all(c["httpOnly"] for c in session), cookies

        # An action through the page: it carries the CSRF cookie's value in the header.
        sent(browser, "POST")  # forget the requests so far
        go(browser, "messages")
        row = next(r for r in rows(browser, "messages")
                   if r.find_element(By.CSS_SELECTOR, "a.open").text == "t-0")
        row.find_element(By.CSS_SELECTOR, "input.select").click()
        browser.find_element(By.ID, "discard-selected").click()
        dialog(browser)
        browser.find_element(By.ID, "discard-reason").send_keys("test order")
        confirm(browser, "Discarded 1 message.")
        discards = [h for p, h in sent(browser, "POST") if p == "/api/discard"]
        assert len(discards) == 1
        assert discards[0]["x-csrf-token"] == cookies[CSRF_COOKIE]["value"]
        assert desk.get("/api/audit")[0]["actor"] == "token"
        assert desk.get(f"/api/messages/{ids['t-0']}")["status"] == "discarded"

        # The desk checks it: with the page's cookies but without the header, or with another
        # value, a POST is refused and changes nothing...
        assert _post_from_page(browser, "/api/discard",
                               {"ids": [ids["t-1"]], "reason": "x"}, None) in (401, 403)
        assert _post_from_page(browser, "/api/discard",
                               {"ids": [ids["t-1"]], "reason": "x"}, "forged") in (401, 403)
        assert desk.get(f"/api/messages/{ids['t-1']}")["status"] == "parked"
        # ...and the same request with the cookie's value goes through (the control).
        assert _post_from_page(browser, "/api/discard", {"ids": [ids["t-1"]], "reason": "x"},
                               cookies[CSRF_COOKIE]["value"]) == 200
        assert desk.get(f"/api/messages/{ids['t-1']}")["status"] == "discarded"

        # Logging out ends the session: the page is shut again.
        browser.find_element(By.ID, "logout").click()
        until(browser, lambda d: _path(d) == "/login", "the login page after logging out")
        browser.get(desk.url + "/")
        until(browser, lambda d: _path(d) == "/login", "the login page for a logged-out browser")


# Each one runs a script if it is ever parsed as HTML: it sets window.__pwned, calls alert()
# and leaves an element the checks look for.
ATTACKS = {
    "body": '<img src=x onerror="window.__pwned=\'body\';alert(\'body\')">'
            "</script><script>window.__pwned='body-script';alert('body-script')</script>",
    "header": '<svg onload="window.__pwned=\'header\';alert(\'header\')"></svg>',
    "exception_type": "<iframe src=\"javascript:alert('type')\"></iframe>Error",
    "exception_message": '</td></tr></table><img src=x onerror="window.__pwned=\'message\'">',
    "message_id": '<b id="injected">m</b>',
    "correlation_id": "\"><script>window.__pwned='corr'</script>",
    "reason": '<img src=x onerror="window.__pwned=\'reason\';alert(\'reason\')">',
}
INJECTED = ("#view img, #view svg, #view iframe, #view script, #injected, [onerror], [onload]")


def _inert(driver: webdriver.Chrome, *shown: str) -> None:
    """The view shows each of ``shown`` as text, and nothing in it was parsed as markup."""
    text = driver.find_element(By.ID, "view").text
    for value in shown:
        assert value in text, f"{value!r} is not shown as text"
    assert driver.execute_script(f"return document.querySelectorAll({json.dumps(INJECTED)})"
                                 ".length") == 0
    assert driver.execute_script("return document.querySelectorAll('script:not([src])').length"
                                 ) == 0
    assert driver.execute_script("return window.__pwned === undefined")
    assert alert_text(driver) is None


def test_a_message_made_to_attack_the_page_is_shown_as_text_and_runs_nothing(
    fresh_vhost: Settings, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    topology = topology_file(fresh_vhost, tmp_path)
    with running_desk(fresh_vhost, topology, tmp_path) as desk:
        park_and_wait(fresh_vhost, desk, "orders", [Parked(
            ATTACKS["body"].encode(), exception_type=ATTACKS["exception_type"],
            message_id=ATTACKS["message_id"],
            properties={"correlation_id": ATTACKS["correlation_id"]},
            headers={"exception-message": ATTACKS["exception_message"],
                     "x-note": ATTACKS["header"]},
        )])
        open_desk(browser, desk)
        _inert(browser)

        go(browser, "groups")
        _inert(browser, ATTACKS["exception_type"])
        go(browser, "messages")
        _inert(browser, ATTACKS["message_id"], ATTACKS["exception_type"])
        row = rows(browser, "messages")[0]
        follow(browser, row.find_element(By.CSS_SELECTOR, "a.open"), "message")
        _inert(browser, ATTACKS["message_id"], ATTACKS["correlation_id"], ATTACKS["body"],
               ATTACKS["header"], ATTACKS["exception_message"])
        screenshot(browser, "hostile")

        # An operator's own text (a discard's reason) is shown as text too.
        browser.find_element(By.ID, "discard-message").click()
        dialog(browser)
        browser.find_element(By.ID, "discard-reason").send_keys(ATTACKS["reason"])
        confirm(browser, "Discarded 1 message.")
        go(browser, "audit")
        _inert(browser, ATTACKS["reason"])
        assert desk.get("/api/audit")[0]["reason"] == ATTACKS["reason"]

        # The controls: the checks above do see an alert and an injected element.
        browser.execute_script("document.getElementById('view').append("
                               "document.createElement('img'))")
        assert browser.execute_script(
            f"return document.querySelectorAll({json.dumps(INJECTED)}).length") == 1
        browser.execute_script("window.setTimeout(() => alert('control'), 0)")
        assert until(browser, alert_text, "the control alert") == "control"
        browser.switch_to.alert.accept()
