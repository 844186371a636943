"""The ``rabbit-retry`` command, on the standard library's argparse.

Each verb lives in a sibling module, imported only when that verb runs: `rabbit-retry worker`
loads neither the operators' verbs nor what they import (rich, httpx). ``VERBS`` names each
verb's module and its one-line summary, so `rabbit-retry --help` lists every verb without
importing any. A verb module's ``COMMANDS`` maps its verbs to a ``Command`` (or a ``Group`` of
them, like ``parking``), which declares the verb's arguments in one function.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rabbit_retry.errors import EXIT_INPUT, EXIT_RUNTIME, InputError, RabbitRetryError
from rabbit_retry.settings import MANAGEMENT_URL_ENV, URL_ENV, Settings, mask

PROG = "rabbit-retry"
DESCRIPTION = "Broker-native retries for RabbitMQ: provision, consume, review what was parked."


@dataclass(frozen=True)
class Verb:
    module: str  # rabbit_retry.cli.<module> defines the verb in its COMMANDS
    summary: str  # the first paragraph of the verb's own description (a unit test checks it)


VERBS: dict[str, Verb] = {
    "apply": Verb("provision", "Create what FILE needs on the broker; a second run changes "
                  "nothing."),
    "desk": Verb("desk", "Consume FILE's parking queues into a store; serve a page and a JSON "
                 "API over them."),
    "export": Verb("provision", "Print FILE as broker definitions JSON, a Mermaid diagram, "
                   "Prometheus alerting rules or a Grafana dashboard for its queues; touches no "
                   "broker."),
    "migrate": Verb("provision", "Rebuild every queue of FILE the broker cannot change in "
                    "place, keeping its messages."),
    "parking": Verb("operate", "Review parked messages: show, replay, purge, export."),
    "plan": Verb("provision", "Compare FILE with the live broker; exit 3 if anything "
                 "conflicts."),
    "status": Verb("operate", "Per queue of FILE: ready, unacked, consumers, retrying, parked; "
                   "then drift."),
    "validate": Verb("provision", "Check FILE and print what it would create; touches no "
                     "broker."),
    "worker": Verb("worker", "Run one or more RetryConsumer classes against the queues of "
                   "FILE."),
}


class UsageError(InputError):
    """The command line itself is wrong (a missing argument, an unknown option, a bad value)."""


class Abort(Exception):
    """The user answered no to a confirmation (or gave no answer): nothing was done."""


# --- output and confirmation ---------------------------------------------------------------


def echo(message: str = "", *, err: bool = False) -> None:
    """``message`` and a newline on stdout (stderr with ``err``), flushed at once so that lines
    of both streams and of a progress bar come out in the order they were written."""
    stream = sys.stderr if err else sys.stdout
    if stream is None:  # no console at all (pythonw): nothing to say it on
        return
    stream.write(f"{message}\n")
    stream.flush()


def confirm(question: str) -> None:
    """Asks ``question [y/N]: `` on stdin; returns on yes. No (the default), end of input or
    Ctrl-C raise ``Abort``, which `main` reports as "aborted", exit 2; anything else asks
    again."""
    while True:
        try:
            answer = input(f"{question} [y/N]: ").strip().lower()
        except (KeyboardInterrupt, EOFError):
            raise Abort from None
        if answer in ("y", "yes"):
            return
        if answer in ("n", "no", ""):
            raise Abort
        echo("Error: invalid input")


def stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


# --- argument types: each check gives one line, ``--option: what is wrong`` -----------------


class IntRange:
    """An integer within ``low``..``high`` (either may be None: no bound)."""

    def __init__(self, low: int | None = None, high: int | None = None) -> None:
        self.low, self.high = low, high
        if low is not None and high is not None:
            self.bounds = f"{low}<=x<={high}"
        else:
            self.bounds = f"x>={low}" if low is not None else f"x<={high}"

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if self.low is not None and self.high is not None:
            if not self.low <= value <= self.high:
                raise argparse.ArgumentTypeError(f"{value} is not in {self.low}..{self.high}")
        elif self.low is not None and value < self.low:
            raise argparse.ArgumentTypeError(f"{value} is less than {self.low}")
        elif self.high is not None and value > self.high:
            raise argparse.ArgumentTypeError(f"{value} is more than {self.high}")
        return value


class FloatRange:
    """A number of at least ``low`` (more than ``low`` when ``open``)."""

    def __init__(self, low: float, *, open: bool = False) -> None:
        self.low, self.open = low, open
        self.bounds = f"x>{low:g}" if open else f"x>={low:g}"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < self.low or (self.open and value == self.low):
            word = "not more than" if self.open else "less than"
            raise argparse.ArgumentTypeError(f"{text} is {word} {self.low:g}")
        return value


class Choice:
    """One of ``values``, spelled exactly."""

    def __init__(self, *values: str) -> None:
        self.values = values
        self.metavar = "{" + ",".join(values) + "}"

    def __call__(self, text: str) -> str:
        if text not in self.values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(self.values)}")
        return text


def file_path(text: str) -> str:
    """A path that is not a directory (it need not exist: the code that opens it says so)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file")
    return text


def writable_file_path(text: str) -> str:
    """``file_path``, and writable if it exists."""
    file_path(text)
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


# --- the parser ----------------------------------------------------------------------------


def _help_width() -> int:
    import shutil

    return max(min(shutil.get_terminal_size().columns, 100) - 2, 40)


class _Formatter(argparse.HelpFormatter):
    """argparse's layout; descriptions keep their paragraphs (each one wrapped), and words
    with hyphens (URLs, file names) are never cut at them."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=_help_width())

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return "\n\n".join(
            textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent,
                          subsequent_indent=indent, break_on_hyphens=False)
            for paragraph in text.split("\n\n") if paragraph.strip()
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """argparse as this command wants it: a wrong command line raises ``UsageError`` (one line,
    exit 2; argparse would print its usage and exit 2 itself), long options are never
    abbreviated, ``-h/--help`` everywhere, and ``commands`` listed at the end of the help.

    ``add_argument`` also takes ``show_default`` (True, or the text to show) and notes the
    default, the range of an ``IntRange`` / ``FloatRange`` and ``required`` in the help.
    """

    def __init__(self, prog: str, description: str | None = None, *, usage: str | None = None,
                 commands: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(prog=prog, usage=usage, description=description,
                         formatter_class=_Formatter, allow_abbrev=False, add_help=False)
        self.commands = list(commands)
        self._names: dict[str, str] = {}  # as argparse shows an argument -> as we do
        self.add_argument("-h", "--help", action="help", help="Show this message and exit.")

    def add_argument(self, *args: Any, show_default: bool | str = False,
                     **kwargs: Any) -> argparse.Action:
        kind = kwargs.get("type")
        if isinstance(kind, Choice) and "metavar" not in kwargs:
            kwargs["metavar"] = kind.metavar
        notes = []
        if show_default is not False:
            default = kwargs.get("default") if show_default is True else show_default
            notes.append(f"default: {default}")
        if isinstance(kind, IntRange | FloatRange):
            notes.append(kind.bounds)
        if kwargs.get("required"):
            notes.append("required")
        if notes and kwargs.get("help") not in (None, argparse.SUPPRESS):
            kwargs["help"] += "  [" + "; ".join(notes).replace("%", "%%") + "]"
        action = super().add_argument(*args, **kwargs)
        if action.option_strings:
            shown = "/".join(action.option_strings)
            long = [s for s in action.option_strings if s.startswith("--")]
            self._names[shown] = (long or action.option_strings)[0]
        else:
            shown = action.metavar if isinstance(action.metavar, str) else action.dest
            self._names[shown] = shown
        return action

    def error(self, message: str) -> NoReturn:
        raise UsageError(self._one_line(message))

    def _one_line(self, message: str) -> str:
        """argparse's message, naming each argument by its long option (``--topology``, not
        ``-t/--topology``) and without its "argument" prefix."""
        required = "the following arguments are required: "
        if message.startswith(required):
            names = [self._names.get(n, n) for n in message[len(required):].split(", ")]
            return f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} required"
        if message.startswith("argument "):
            rest = message[len("argument "):]
            # The longest first: "--url" must not claim a message about "--url-list".
            for shown in sorted(self._names, key=len, reverse=True):
                if rest.startswith(f"{shown}: "):
                    return f"{self._names[shown]}: {rest[len(shown) + 2:]}"
            return rest
        return message

    def format_help(self) -> str:
        text = super().format_help()
        if not self.commands:
            return text
        import textwrap

        width = _help_width()
        column = max(len(name) for name, _ in self.commands) + 4
        lines = ["commands:"]
        for name, summary in self.commands:
            lines.append(textwrap.fill(summary, width, initial_indent=f"  {name:<{column - 2}}",
                                       subsequent_indent=" " * column, break_on_hyphens=False))
        return text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=0, help="Show the version and exit.")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        from importlib.metadata import version

        echo(f"{PROG}, version {version('rabbit-retry')}")
        parser.exit()


# --- commands ------------------------------------------------------------------------------


def _no_arguments(parser: Parser) -> None:
    pass


def _description(doc: str | None) -> str:
    """A docstring as help: its first line, then the rest without the common indentation."""
    import textwrap

    first, _, rest = (doc or "").strip().partition("\n")
    return f"{first}\n{textwrap.dedent(rest)}".strip()


@dataclass(frozen=True)
class Command:
    """A verb: ``arguments`` adds its arguments to its parser; ``run(settings, **values)`` gets
    the parsed values by their ``dest``. Its help is ``run``'s docstring; ``summary`` is the
    line that lists it in its group's help."""

    run: Callable[..., None]
    arguments: Callable[[Parser], None] = _no_arguments
    summary: str = ""

    @property
    def description(self) -> str:
        return _description(self.run.__doc__)


@dataclass(frozen=True)
class Group:
    """A verb with verbs of its own (``rabbit-retry parking show ...``)."""

    description: str
    commands: Mapping[str, Command]


# The options that come before the verb (and after it too: hoist_global_options). Their
# environment variables are read where the options are used (``_settings``, Settings).
_GLOBAL_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--url", {"action": "append", "metavar": "URL", "help":
               "AMQP URL; its path is the vhost. The nodes of a cluster: a comma-separated list "
               "or the option repeated, tried in order."}),
    ("--management-url", {"action": "append", "metavar": "URL", "help":
                          "HTTP management API URL; a list, like --url, for a cluster."}),
    ("--ca-file", {"type": file_path, "metavar": "FILE", "help":
                   "PEM CA certificate that signed the broker's (amqps:// and https://)."}),
    ("--cert-file", {"type": file_path, "metavar": "FILE", "help":
                     "PEM client certificate, for brokers that require one."}),
    ("--key-file", {"type": file_path, "metavar": "FILE", "help":
                    "PEM private key of --cert-file (password, if any: "
                    "RABBIT_RETRY_KEY_PASSWORD)."}),
    ("--debug", {"action": "store_true", "help": "Show tracebacks."}),
)
_GLOBAL_FLAGS = tuple(name for name, spec in _GLOBAL_OPTIONS if spec.get("action") == "store_true")
_GLOBAL_WITH_VALUE = tuple(name for name, _ in _GLOBAL_OPTIONS if name not in _GLOBAL_FLAGS)


def _top_parser() -> Parser:
    parser = Parser(PROG, DESCRIPTION, usage=f"{PROG} [OPTIONS] COMMAND [ARGS]...",
                    commands=[(name, verb.summary) for name, verb in sorted(VERBS.items())])
    for name, spec in _GLOBAL_OPTIONS:
        parser.add_argument(name, **spec)
    parser.add_argument("--version", action=_Version)
    return parser


def _split(args: list[str], with_value: Sequence[str]) -> tuple[list[str], str | None, list[str]]:
    """``args`` as (the options before the verb, the verb or None, what follows the verb).
    The verb is the first word that is neither an option nor the value of one of
    ``with_value``; after ``--`` it is the next word, whatever it looks like."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return args[:i], (args[i + 1] if i + 1 < len(args) else None), args[i + 2 :]
        if arg == "-" or not arg.startswith("-"):
            return args[:i], arg, args[i + 1 :]
        i += 2 if arg in with_value else 1
    return args, None, []


def _no_verb(parser: Parser) -> NoReturn:
    """No verb given: the help, on stderr, and exit 2 (as click did)."""
    parser.print_help(sys.stderr)
    sys.exit(EXIT_INPUT)


def _settings(options: argparse.Namespace) -> Settings:
    # An environment variable holding a list may separate its URLs by commas or by spaces.
    return Settings.from_env(
        options.url or os.environ.get(URL_ENV, "").split(),
        options.management_url or os.environ.get(MANAGEMENT_URL_ENV, "").split(),
        ca_file=options.ca_file,
        cert_file=options.cert_file,
        key_file=options.key_file,
    )


def commands_of(verb: str) -> Command | Group:
    """What ``verb`` runs, from its module (imported now)."""
    module = importlib.import_module(f"rabbit_retry.cli.{VERBS[verb].module}")
    commands: Mapping[str, Command | Group] = module.COMMANDS
    return commands[verb]


def _run(args: list[str]) -> None:
    top = _top_parser()
    front, verb, rest = _split(args, _GLOBAL_WITH_VALUE)
    options = top.parse_args(front)
    if verb is None:
        _no_verb(top)
    if verb not in VERBS:
        raise UsageError(f"no such command {verb!r} ({PROG} --help lists them)")
    prog = f"{PROG} {verb}"
    command = commands_of(verb)
    if isinstance(command, Group):
        group = Parser(prog, command.description, usage=f"{prog} [-h] COMMAND [ARGS]...",
                       commands=[(name, c.summary) for name, c in sorted(command.commands.items())])
        front, name, rest = _split(rest, ())
        group.parse_args(front)
        if name is None:
            _no_verb(group)
        if name not in command.commands:
            raise UsageError(f"no such command {name!r} ({prog} --help lists them)")
        prog = f"{prog} {name}"
        command = command.commands[name]
    if rest and rest[-1] in _GLOBAL_WITH_VALUE and "--" not in rest:
        # Left behind by hoist_global_options: the option ends the command line, with no value.
        raise UsageError(f"{rest[-1]}: expected one argument")
    parser = Parser(prog, command.description)
    command.arguments(parser)
    values = vars(parser.parse_args(rest))
    command.run(_settings(options), **values)


def _register() -> None:
    """Imports every verb's module (what `main` imports only for the verb it runs)."""
    for verb in VERBS.values():
        importlib.import_module(f"rabbit_retry.cli.{verb.module}")


def hoist_global_options(args: list[str]) -> list[str]:
    """``args`` with the global options moved in front, in order; nothing after ``--`` moves.
    No verb has an option of the same name, so moving them changes no meaning."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        if arg in _GLOBAL_FLAGS or (arg.split("=", 1)[0] in _GLOBAL_WITH_VALUE and "=" in arg):
            front.append(arg)
        elif arg in _GLOBAL_WITH_VALUE and i + 1 < len(args):
            front.extend(args[i : i + 2])
            i += 1
        else:
            rest.append(arg)
        i += 1
    return front + rest


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors, and the exit codes the README lists under "Commands"."""
    args = hoist_global_options(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if not debug:
        # The AMQP client logs each failed connect itself; we already say it in one line.
        for name in ("aiormq", "aio_pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        _run(args)
    except Abort:
        echo("aborted", err=True)
        sys.exit(EXIT_INPUT)
    except RabbitRetryError as exc:
        if debug:
            _print_traceback()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            echo(f"error: {mask(line)}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # the last line of defence: one line, never a traceback
        if debug:
            _print_traceback()
        echo(
            f"error: unexpected {type(exc).__name__}: {mask(str(exc))} (run with --debug for "
            "details)",
            err=True,
        )
        sys.exit(EXIT_RUNTIME)
    sys.exit(0)


def _print_traceback() -> None:
    import traceback

    traceback.print_exc()
