"""YAML text -> ``Topology``, with every error naming the file, the line and the key.

Each problem is one line: ``FILE:LINE: key.path: message``. Text that is not YAML at all has no
key path, so its lines read ``FILE:LINE: message``. The YAML is read node by node rather than
through a loader's constructor, so that every key and list item keeps its line, duplicate keys
are reported with both lines, and keys that YAML reads as numbers, booleans or null are caught
instead of silently turning into the wrong name.
"""

from __future__ import annotations

import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.reader import ReaderError

from rabbit_retry.errors import InputError
from rabbit_retry.text import clip, shorten
from rabbit_retry.topology.check import Path as KeyPath
from rabbit_retry.topology.check import check
from rabbit_retry.topology.model import SUPPORTED_VERSION, TopologySpec, resolve
from rabbit_retry.topology.resolved import Topology

# A file this large is a mistake (or an alias bomb), never a topology. The byte limit is
# checked before any parsing, so a wrong file is refused at once: a topology of a thousand
# queues is a few hundred kilobytes.
MAX_FILE_BYTES = 1024 * 1024
MAX_VALUES = 100_000
MAX_DEPTH = 64

_TAG = "tag:yaml.org,2002:"
_KEY_KINDS = {"int": "a number", "float": "a number", "bool": "a boolean", "null": "null"}
_KEY_KINDS |= {"timestamp": "a date"}
_SCALAR_KINDS = frozenset({"str", "int", "float", "bool", "null", "timestamp"})


class TopologyError(InputError):
    """One or more problems in a topology file; ``str()`` is one line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def load_topology(path: str | Path) -> Topology:
    """Read, check and resolve a topology file; ``TopologyError`` (exit code 2) if it is wrong."""
    source = str(path)
    try:
        with Path(path).open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise TopologyError([f"{source}: no such file"]) from None
    except IsADirectoryError:
        raise TopologyError([f"{source}: is a directory, not a topology file"]) from None
    except OSError as exc:
        raise TopologyError([f"{source}: cannot read ({exc.strerror})"]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise TopologyError([_too_large(source)])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        byte = raw[exc.start]
        raise TopologyError(
            [f"{source}:{line}: not UTF-8 text: byte 0x{byte:02x} cannot be decoded ({exc.reason})"]
        ) from None
    return parse_topology(text, source)


def parse_topology(text: str, source: str = "<topology>") -> Topology:
    """Like ``load_topology``, for text already in hand; ``source`` names it in messages."""
    if len(text) > MAX_FILE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise TopologyError([_too_large(source)])
    document, lines = _read_yaml(text, source)
    if document is None:
        raise TopologyError([f"{source}:1: the file is empty; expected a mapping with version: 1"])
    if not isinstance(document, dict):
        raise TopologyError(
            [
                f"{source}:1: expected a mapping with version: 1 at the top level, got "
                f"{shorten(document)}"
            ]
        )
    try:
        spec = TopologySpec.model_validate(document)
    except ValidationError as exc:
        problems = [(_path_of(e), _message(e)) for e in exc.errors(include_url=False)]
        raise TopologyError(_format_all(problems, lines, source)) from None
    found = check(spec)
    if found:
        raise TopologyError(_format_all([(p.path, p.message) for p in found], lines, source))
    return resolve(spec, source)


def _too_large(source: str) -> str:
    return (
        f"{source}: the file is larger than {MAX_FILE_BYTES // 2**20} MiB ({MAX_FILE_BYTES} "
        "bytes), the most a topology file may hold; is it the right file?"
    )


# --- YAML ---------------------------------------------------------------------------------------


def _read_yaml(text: str, source: str) -> tuple[Any, dict[KeyPath, int]]:
    yaml = YAML(typ="safe", pure=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = yaml.compose(text)
    except MarkedYAMLError as exc:
        raise TopologyError([_syntax_line(exc, source)]) from None
    except ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        what = f"character #x{code:04x}" if isinstance(code, int) else "a character"
        raise TopologyError(
            [f"{source}:{line}: not valid YAML: {what} is not allowed ({exc.reason})"]
        ) from None
    except YAMLError as exc:
        raise TopologyError([f"{source}:1: not valid YAML: {_one_line(str(exc))}"]) from None
    except RecursionError:
        raise TopologyError([f"{source}:1: not valid YAML: nested too deeply"]) from None
    if root is None:
        return None, {}
    builder = _Builder(yaml, source)
    document = builder.build(root, ())
    if builder.problems:
        raise TopologyError(_sorted_unique(builder.problems))
    return document, builder.lines


def _syntax_line(exc: MarkedYAMLError, source: str) -> str:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else 1
    what = _one_line(exc.problem or exc.context or "cannot parse")
    context = exc.context_mark
    if exc.context and what.startswith("but "):
        what = f"{_one_line(exc.context)}, {what}"
    elif exc.context and context is not None and context.line + 1 != line:
        what += f" ({_one_line(exc.context)} that starts on line {context.line + 1})"
    if "'\\t'" in what:
        what += "; indent with spaces, not tabs"
    return f"{source}:{line}: not valid YAML: {what}"


class _Builder:
    """YAML nodes -> plain Python values, remembering the line of every key and list item."""

    def __init__(self, yaml: YAML, source: str) -> None:
        self.source = source
        self.lines: dict[KeyPath, int] = {}
        self.problems: list[tuple[int, str]] = []
        self._constructor = yaml.constructor
        self._open: set[int] = set()  # nodes being built: meeting one again means a cycle
        self._built: set[int] = set()  # collections built once: meeting one again is an alias
        self._aliased = False
        self._reported: set[tuple[int, str]] = set()
        self._count = 0

    def problem(self, node: Node, path: KeyPath, message: str) -> None:
        line = node.start_mark.line + 1
        if (id(node), message) not in self._reported:  # an anchor's flaw, reported once
            self._reported.add((id(node), message))
            self.problems.append((line, _format(self.source, line, path, message)))

    def build(self, node: Node, path: KeyPath, depth: int = 0) -> Any:
        self._count += 1
        if self._count > MAX_VALUES or depth > MAX_DEPTH:
            line = node.start_mark.line + 1
            aliases = " (check its anchors and aliases)" if self._aliased else ""
            why = (
                f"more than {MAX_VALUES} values{aliases}"
                if self._count > MAX_VALUES
                else f"nested more than {MAX_DEPTH} levels deep"
            )
            raise TopologyError([f"{self.source}:{line}: the file is too large: {why}"])
        if isinstance(node, ScalarNode):
            return self._scalar(node, path)
        if id(node) in self._open:
            self.problem(node, path, "a YAML alias refers to a value that contains it")
            return None
        self._open.add(id(node))
        self._aliased = self._aliased or id(node) in self._built
        self._built.add(id(node))
        try:
            if isinstance(node, SequenceNode) and str(node.tag) == _TAG + "seq":
                items = []
                for index, item in enumerate(node.value):
                    self.lines[(*path, index)] = item.start_mark.line + 1
                    items.append(self.build(item, (*path, index), depth + 1))
                return items
            if isinstance(node, MappingNode) and str(node.tag) == _TAG + "map":
                return {
                    key: self.build(value, (*path, key), depth + 1)
                    for key, value in self._entries(node, path)
                }
            self.problem(node, path, f"unsupported YAML tag {_tag(node)!r}")
            return None
        finally:
            self._open.discard(id(node))

    def _scalar(self, node: ScalarNode, path: KeyPath) -> Any:
        if str(node.tag).removeprefix(_TAG) not in _SCALAR_KINDS:
            self.problem(node, path, f"unsupported YAML tag {_tag(node)!r}")
            return None
        try:
            return self._constructor.construct_object(node, deep=True)
        except MarkedYAMLError as exc:
            self.problem(node, path, _one_line(exc.problem or "cannot read this value"))
        except (ValueError, OverflowError) as exc:
            self.problem(node, path, f"cannot read this value ({_one_line(str(exc))})")
        return None

    def _entries(self, node: MappingNode, path: KeyPath) -> list[tuple[str, Node]]:
        """Key/value pairs with ``<<`` merges applied: written keys win over merged ones."""
        entries: dict[str, Node] = {}
        first_line: dict[str, int] = {}
        merges: list[Node] = []
        for key_node, value_node in node.value:
            if str(key_node.tag) == _TAG + "merge":
                merges.append(value_node)
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            line = key_node.start_mark.line + 1
            if key in first_line:
                self.problem(
                    key_node,
                    (*path, key),
                    f"duplicate key, first defined on line {first_line[key]}",
                )
                continue
            first_line[key] = line
            self.lines[(*path, key)] = line
            entries[key] = value_node
        for merge in merges:
            sources = merge.value if isinstance(merge, SequenceNode) else [merge]
            for source in sources:
                if not isinstance(source, MappingNode):
                    self.problem(merge, path, "'<<' merges a mapping or a list of mappings")
                    continue
                if id(source) in self._open:
                    self.problem(merge, path, "a YAML alias refers to a value that contains it")
                    continue
                self._open.add(id(source))
                try:
                    for key, value_node in self._entries(source, path):
                        if key not in entries:
                            entries[key] = value_node
                            first_line[key] = self.lines[(*path, key)]
                finally:
                    self._open.discard(id(source))
        for key, line in first_line.items():
            self.lines[(*path, key)] = line
        return list(entries.items())

    def _key(self, node: Node, path: KeyPath) -> str | None:
        if not isinstance(node, ScalarNode):
            self.problem(node, path, "a key must be a name, not a list or a mapping")
            return None
        kind = str(node.tag).removeprefix(_TAG)
        if kind == "str":
            return str(node.value)
        if kind == "null":
            self.problem(node, path, "a key is empty (null); write a name")
            return None
        described = _KEY_KINDS.get(kind, f"a {kind}")
        self.problem(
            node,
            path,
            f"key {node.value} reads as {described}, not a name; quote it: '{node.value}'",
        )
        return None


def _tag(node: Node) -> str:
    tag = str(node.tag)
    return "!!" + tag.removeprefix(_TAG) if tag.startswith(_TAG) else tag


# --- messages -----------------------------------------------------------------------------------


def _path_of(error: ErrorDetails) -> KeyPath:
    return tuple(p for p in error["loc"] if isinstance(p, str | int))


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    path = _path_of(error)
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if path == ("version",) and isinstance(value, str) and value.strip() == str(SUPPORTED_VERSION):
        return (
            f"must be the integer {SUPPORTED_VERSION}, not the string {value!r}; "
            f"write version: {SUPPORTED_VERSION} without quotes"
        )
    if path == ("version",) and kind != "missing":
        return f"unsupported version {shorten(value)}; this tool reads version: {SUPPORTED_VERSION}"
    if kind == "extra_forbidden":
        return _unknown_key(path)
    if kind == "missing":
        return "required key is missing"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind == "too_short" and path == ("queues",):
        return "declare at least one queue"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    if kind == "greater_than_equal":
        return f"must be at least {ctx.get('ge')}, got {shorten(value)}"
    if kind == "less_than_equal":
        return f"must be at most {ctx.get('le')}, got {shorten(value)}"
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}, got {shorten(value)}"
    expected = {
        "int_type": "a whole number",
        "bool_type": "true or false",
        "dict_type": "a mapping",
        "model_type": "a mapping",
        "list_type": "a list",
    }
    if kind in expected:
        return f"expected {expected[kind]}, got {shorten(value)}"
    if kind == "string_type":
        quote = "; quote it" if isinstance(value, int | float) else ""
        return f"expected a string, got {shorten(value)}{quote}"
    msg = error["msg"]
    return f"{msg[:1].lower()}{msg[1:]}, got {shorten(value)}"


def _unknown_key(path: KeyPath) -> str:
    key = str(path[-1])
    message = f"unknown key {shorten(key)}"
    model = _model_at(path[:-1])
    if model is None:
        return message
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(key, allowed, n=1) or [
        name for name in allowed if key and (key in name or name in key)
    ]
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message + f" (allowed: {', '.join(allowed)})"


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    """The schema model that describes the mapping at ``path``, if one does."""
    annotation: Any = TopologySpec
    for part in path:
        annotation = _strip_optional(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        elif typing.get_origin(annotation) in (list, tuple):
            annotation = typing.get_args(annotation)[0]
        else:
            return None
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def _format_all(
    problems: list[tuple[KeyPath, str]], lines: dict[KeyPath, int], source: str
) -> list[str]:
    located = []
    for path, message in problems:
        line = _line_of(lines, path)
        located.append((line, _format(source, line, path, message)))
    return _sorted_unique(located)


def _sorted_unique(located: list[tuple[int, str]]) -> list[str]:
    ordered = sorted(located, key=lambda item: item[0])
    return list(dict.fromkeys(text for _, text in ordered))


def _line_of(lines: dict[KeyPath, int], path: KeyPath) -> int:
    """Line of the deepest part of ``path`` the file has (a missing key: its parent's line)."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return 1


def _format(source: str, line: int, path: KeyPath, message: str) -> str:
    return f"{source}:{line}: {_dotted(path)}: {message}"


def _dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if part and part.isprintable() else repr(part)
            out += f".{clip(text)}" if out else clip(text)
    return out or "(top level)"


def _one_line(text: str) -> str:
    return " ".join(text.split())
