"""The failure desk's page as files (no browser): it can be served under a strict
Content-Security-Policy (``default-src 'self'``: no inline script, handler or style, nothing from
another origin), it never parses data as HTML, and every file it loads is in the package."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from importlib.resources import files
from pathlib import Path

import pytest

STATIC = Path(str(files("rabbit_retry.desk").joinpath("static")))
HTML = sorted(STATIC.glob("*.html"))
SCRIPTS = sorted(STATIC.rglob("*.js"))

# Ways to turn a string into markup or code: data must never reach one.
SINKS = re.compile(
    r"\binnerHTML\b|\bouterHTML\b|\binsertAdjacentHTML\b|\bdocument\.write|\beval\s*\(|"
    r"\bnew\s+Function\b|\bcreateContextualFragment\b|\bsetTimeout\s*\(\s*['\"`]|"
    r"\bsrcdoc\b|\bjavascript:"
)
IMPORT = re.compile(r"""^\s*import\b[^'"]*?['"]([^'"]+)['"]""", re.MULTILINE)


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self.references: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        for name, value in attrs:
            if name.startswith("on"):
                self.problems.append(f"<{tag} {name}=...>: an inline handler")
            if name == "style":
                self.problems.append(f"<{tag} style=...>: an inline style")
            if name in ("src", "href", "action") and value and not value.startswith(("/", "#")):
                self.problems.append(f"<{tag} {name}={value!r}>: not this origin's path")
            if name in ("src", "href") and value and value.startswith("/static/"):
                self.references.append(value)
        if tag == "script":
            if not names.get("src"):
                self.problems.append("<script> without src: an inline script")
            self._in_script = True
        if tag == "style":
            self.problems.append("<style>: an inline style sheet")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.problems.append("a <script> with a body: inline code")


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def test_the_page_has_its_files() -> None:
    assert {p.name for p in HTML} == {"index.html", "login.html"}
    assert (STATIC / "js" / "app.js").is_file()


@pytest.mark.parametrize("path", HTML, ids=lambda p: p.name)
def test_html_has_nothing_inline_and_nothing_from_elsewhere(path: Path) -> None:
    assert _parse(path).problems == []


@pytest.mark.parametrize("path", HTML, ids=lambda p: p.name)
def test_every_file_an_html_page_loads_exists(path: Path) -> None:
    references = _parse(path).references
    assert references, f"{path.name} loads nothing from /static/"
    missing = [r for r in references if not (STATIC / r.removeprefix("/static/")).is_file()]
    assert missing == []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(STATIC)))
def test_scripts_never_turn_data_into_markup_or_code(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # Comments may name the sinks (to say they are not used); code may not.
    code = re.sub(r"//[^\n]*", "", text)
    assert SINKS.findall(code) == []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(STATIC)))
def test_scripts_import_only_files_of_the_page(path: Path) -> None:
    for target in IMPORT.findall(path.read_text(encoding="utf-8")):
        assert target.startswith("./") or target.startswith("../"), (
            f"{path.name} imports {target!r}: only relative imports of the page's own files"
        )
        assert (path.parent / target).resolve().is_file(), f"{path.name} imports missing {target}"


def test_the_checks_catch_what_they_look_for() -> None:
    """Positive controls: each rule finds its fault in a page made to have it."""
    page = _Page()
    page.feed('<script>alert(1)</script><img src="/static/a.png" onerror="a()"><p style="x">'
              '<script src="https://cdn.example/x.js"></script>')
    assert page.problems == [
        "<script> without src: an inline script",
        "a <script> with a body: inline code",
        "<img onerror=...>: an inline handler",
        "<p style=...>: an inline style",
        "<script src='https://cdn.example/x.js'>: not this origin's path",
    ]
    assert SINKS.findall("el.innerHTML = data; el.insertAdjacentHTML('x', d); eval(s)") == [
        "innerHTML", "insertAdjacentHTML", "eval(",
    ]
