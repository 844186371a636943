"""Which parked messages failed for the same cause: a fingerprint of queue, reason, exception
type and the exception message with its variable parts taken out. Pure.

Two failures are "the same cause" for an operator when one fix (and one replay) deals with both:
``order 123 not found`` and ``order 456 not found``, ``timeout after 30s`` and ``timeout after
31s``. ``normalise`` replaces what varies from message to message with a placeholder:

=============  ==========================================================================
``<n>``        a number not glued to a letter (``123``, ``3.5``, ``ord_42``; not ``utf8``)
``<id>``       a UUID; or a token of letters and digits that holds 4+ digits (``ORD12345``,
               ``sku-AB00989``), or is 10+ characters with 2+ digits, or is a run of 8+ hex
               digits (``507f1f77bcf86cd7``) -- not a word with a digit or three (``sha256``)
``<hex>``      ``0x7f3a`` (an address, mostly)
``<time>``     an ISO date or timestamp, or a clock time ``12:04:59``
``<email>``    an e-mail address
``<ip>``       an IPv4 or IPv6 address
``<query>``    a URL's query string and fragment (the scheme, host and path stay, user and
               password go; punctuation after the URL, a closing bracket too, stays outside)
``<str>``      a quoted value longer than 64 characters, and pydantic's ``input_value=...``
=============  ==========================================================================

Quoted values (``'...'``, ``"..."``) up to 64 characters are kept, with their own variable parts
replaced (``'ord_<n>'``): short quoted values are mostly names from the code or the schema (a
``KeyError``'s key, a missing column, a constraint, a module, a status line) and they ARE the
cause, so ``KeyError: 'sku'`` and ``KeyError: 'price'`` stay apart. The cost: a short quoted
data value (``user 'alice' not found``) splits its group by value. Longer quoted values are
mostly data (SQL text, a payload, user input) and become ``<str>``; a quoted URL is kept at any
length, since the endpoint is the cause. Whitespace runs become one space, and the result is cut
to ``MAX_LENGTH`` characters (never inside a placeholder).

``normalise`` is idempotent and total: any ``str`` (lone surrogates included) goes in, nothing
raises. ``group_id`` is a SHA-256 over an unambiguous encoding of its parts, so it is the same in
every process and Python version; changing the rules here changes ids, and the golden ids in
tests/unit/test_desk_groups.py say so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rabbit_retry.errors import InputError

MAX_LENGTH = 500  # characters of a normalised message that count
QUOTED_MAX = 64  # a quoted value longer than this, once normalised, becomes <str>
_INPUT_MAX = 4 * MAX_LENGTH  # only this much of a message is read (the worker stores <= 2 KiB)
_MAX_ROUNDS = 16  # see normalise(); two rounds are the rule, the bound is a guard

PLACEHOLDERS = ("<n>", "<id>", "<hex>", "<time>", "<email>", "<ip>", "<query>", "<str>")

_NOT_AN = r"(?<![A-Za-z0-9])"  # not glued to a letter or digit before...
_NO_AN_AFTER = r"(?![A-Za-z0-9])"  # ...or after
_HEX = "[0-9a-fA-F]"

# The variable parts, tried in this order at each position (so a UUID is not read as numbers).
_PARTS = [
    ("email", r"(?<![\w.%+-])[\w.%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![\w-])"),
    ("id", rf"{_NOT_AN}{_HEX}{{8}}(?:-{_HEX}{{4}}){{3}}-{_HEX}{{12}}{_NO_AN_AFTER}"),
    (
        "time",
        rf"{_NOT_AN}\d{{4}}-\d{{2}}-\d{{2}}"
        r"(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
        rf"{_NO_AN_AFTER}"
        rf"|(?<![A-Za-z0-9:.])\d{{1,2}}:\d{{2}}:\d{{2}}(?:[.,]\d+)?(?![A-Za-z0-9:])",
    ),
    (
        "ip",
        r"(?<![A-Za-z0-9.])(?:\d{1,3}\.){3}\d{1,3}(?![A-Za-z0-9]|\.\d)"
        rf"|(?<![A-Za-z0-9:])(?=[0-9a-fA-F:]*\d)(?:{_HEX}{{0,4}}:){{2,7}}{_HEX}{{1,4}}"
        r"(?![A-Za-z0-9:])",
    ),
    ("hex", rf"{_NOT_AN}0[xX]{_HEX}+{_NO_AN_AFTER}"),
    (
        # One placeholder for every id scheme of letters and digits: an id that happens to be
        # all hex, or to hold many digits, must not land in another group than its siblings.
        "id",
        rf"{_NOT_AN}(?=[A-Za-z0-9]*[A-Za-z])(?=[A-Za-z0-9]*\d)"
        r"(?:(?=(?:[A-Za-z]*\d){4})"  # 4+ digits: ORD12345, AB00989
        r"|(?=[A-Za-z0-9]{10})(?=(?:[A-Za-z]*\d){2})"  # 10+ characters, 2+ digits
        rf"|(?={_HEX}{{8,}}{_NO_AN_AFTER}))"  # a run of 8+ hex digits
        rf"[A-Za-z0-9]+{_NO_AN_AFTER}",
    ),
    ("n", rf"{_NOT_AN}\d+(?:[.,]\d+)*"),
]
_URL = r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+"


def _alternation(parts: list[tuple[str, str]]) -> str:
    return "|".join(f"(?P<{name}{i}>{pattern})" for i, (name, pattern) in enumerate(parts))


_PARTS_RE = re.compile(_alternation(_PARTS))
_URL_RE = re.compile(_URL)
_WHOLE_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")  # also once normalised (<n>, <query>)
_TOP_RE = re.compile(
    # pydantic's "[type=int_parsing, input_value='abc', input_type=str]": the value is data.
    r"(?P<input>input_value=).*?(?=, input_type=)"
    rf"|(?P<url>{_URL})"
    # A quote that opens after a letter is an apostrophe (user's), not a quoted value.
    r"|(?<![\w>])'(?P<single>[^'\n]*)'(?![\w<])"
    r"|(?<![\w>])\"(?P<double>[^\"\n]*)\"(?![\w<])"
    f"|{_alternation(_PARTS)}"
)
_WHITESPACE = re.compile(r"\s+")
# The built-in placeholders and an operator rule's (``Rule.name``): never cut in the middle.
_PLACEHOLDER = re.compile(r"<[a-z][a-z_]{0,23}>")
_CLOSING = {")": "(", "]": "[", "}": "{"}
_TRAILING = ".,;:!?" + "".join(_CLOSING)


def _part(match: re.Match[str]) -> str:
    name = match.lastgroup or ""
    return "<" + name.rstrip("0123456789") + ">"


def _variable_parts(text: str) -> str:
    return _PARTS_RE.sub(_part, text)


def _url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    location, query = rest[:cut], rest[cut:]
    authority, slash, path = location.partition("/")
    host = authority.rpartition("@")[2]  # a user and password never count, nor show
    tail = query[:1] + "<query>" if len(query) > 1 else query
    return f"{scheme}://{_variable_parts(host + slash + path)}{tail}"


def _url_in_text(url: str) -> str:
    """A URL as found in running text: punctuation that ends the sentence after it, or a bracket
    that closes around it (``(see https://h/p?a=1)``), is not part of it."""
    end = len(url)
    while end and url[end - 1] in _TRAILING:
        char = url[end - 1]
        if char in _CLOSING and url.count(_CLOSING[char], 0, end) >= url.count(char, 0, end):
            break  # balanced inside the URL: https://h/orders/(draft)
        end -= 1
    return _url(url[:end]) + url[end:]


def _top(match: re.Match[str]) -> str:
    if match.group("input") is not None:
        return "input_value=<str>"
    url = match.group("url")
    if url is not None:
        return _url_in_text(url)
    for group, quote in (("single", "'"), ("double", '"')):
        body = match.group(group)
        if body is not None:
            inner = _URL_RE.sub(lambda m: _url_in_text(m.group()), body)
            inner = _variable_parts(inner)
            if len(inner) <= QUOTED_MAX or _WHOLE_URL.fullmatch(inner):
                return quote + inner + quote
            return "<str>"
    return _part(match)


def _round(text: str) -> str:
    return _WHITESPACE.sub(" ", _TOP_RE.sub(_top, text)).strip()


def _cut(text: str) -> str:
    if len(text) <= MAX_LENGTH:
        return text
    end = MAX_LENGTH
    for start in range(max(end - 6, 0), end):
        found = _PLACEHOLDER.match(text, start)
        if found is not None and found.end() > end:
            end = start
            break
    return text[:end].rstrip()


@functools.lru_cache(maxsize=8192)  # a flood of one cause repeats its messages
def normalise(message: str) -> str:
    """``message`` with its variable parts replaced by placeholders (see the module's table).

    One round of replacements can expose another (a quote that followed a replaced number now
    follows ``>``; cutting to length ends a token early), so rounds repeat until nothing
    changes. Each round that changes anything replaces characters by placeholders or drops
    some, so this ends; the result is a fixed point, hence ``normalise(normalise(x)) ==
    normalise(x)``.
    """
    text = message[:_INPUT_MAX]
    for _ in range(_MAX_ROUNDS):
        done = _cut(_round(text))
        if done == text:
            break
        text = done
    return text


def group_id(
    queue: str, exception_type: str | None, message: str | None, *, reason: str | None
) -> str:
    """A stable 16-hex-digit id of the cause: queue, park reason, exception type, ``normalise``d
    message.

    ``reason`` (``parked-reason``) always counts: a message parked ``invalid`` or ``exhausted``
    without an exception still groups (with the others of its queue and reason), and the same
    exception parked ``permanent`` after a deploy and ``exhausted`` before it lands in two
    groups, each replayed on its own terms. A missing type or message counts as empty.
    """
    parts = [queue, reason or "", (exception_type or "").strip(), normalise(message or "")]
    # JSON with \u escapes: unambiguous (no separator can occur inside a part) and pure ASCII,
    # lone surrogates included.
    key = json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(key.encode("ascii")).hexdigest()[:16]


# --- an operator's own rules -------------------------------------------------------------------

RULE_PATTERN_MAX = 200
_RULE_NAME = re.compile(r"[a-z][a-z_]{0,23}")


@dataclass(frozen=True, slots=True)
class Rule:
    """An operator's grouping rule: whatever ``pattern`` (a Python regular expression) matches
    in an exception message becomes ``<name>`` before the built-in rules run; for one queue's
    messages, or (``queue`` None) every queue's."""

    pattern: str
    name: str
    queue: str | None = None


def check_rule(rule: Rule) -> re.Pattern[str]:
    """The rule's compiled pattern; ``InputError`` (one line) when it cannot work."""
    if not _RULE_NAME.fullmatch(rule.name):
        raise InputError("name: 1 to 24 lowercase letters or _ (it becomes <name>)")
    if len(rule.pattern) > RULE_PATTERN_MAX:
        raise InputError(f"pattern: at most {RULE_PATTERN_MAX} characters")
    try:
        compiled = re.compile(rule.pattern)
    except re.error as exc:
        raise InputError(f"pattern: not a regular expression: {exc.msg}") from None
    except (RecursionError, OverflowError):
        raise InputError("pattern: too deeply nested") from None
    if compiled.search("") is not None:
        raise InputError("pattern: matches an empty text (every message would change)")
    return compiled


class Grouping:
    """The built-in rules plus an operator's (``Rule``): each parked message's pattern and group.

    Operator rules go first, in the order given, so they can name what the built-in ones
    would keep (a tenant, a shard) or take a whole variable phrase at once."""

    def __init__(self, rules: Sequence[Rule] = ()) -> None:
        self.rules = tuple(rules)
        self._compiled = [(rule.queue, check_rule(rule), f"<{rule.name}>") for rule in rules]

    def pattern(self, queue: str, message: str | None) -> str:
        text = (message or "")[:_INPUT_MAX]
        for only, compiled, placeholder in self._compiled:
            if only is None or only == queue:
                text = compiled.sub(placeholder, text)
        return normalise(text)

    def group(self, queue: str, reason: str | None, exception_type: str | None,
              message: str | None) -> tuple[str, str]:
        """(group id, pattern) of a parked message."""
        pattern = self.pattern(queue, message)
        return group_id(queue, exception_type, pattern, reason=reason), pattern
