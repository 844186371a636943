"""The ``rabbit-retry`` command line, on click.

Adding a verb: a click command in a module of this package, listed in that module's
``COMMANDS``; name the module in ``VERBS`` below. Its docstring is its help (the first paragraph
is its line in ``rabbit-retry --help``); ``@pass_settings`` gives it the connection settings::

    @click.command()
    @click.argument("file", type=click.Path(dir_okay=False), metavar="FILE")
    @click.option("--limit", type=click.IntRange(min=1), metavar="N", help="At most N.")
    @pass_settings
    def relay(settings: Settings, file: str, limit: int | None) -> None:
        'What it does, in one line.'

    COMMANDS = {"relay": relay}  # and here: VERBS["relay"] = "that module"

A verb with verbs of its own is a ``@click.group(cls=Group)`` (``parking``, in operate.py).
The module is imported only when its verb runs: `rabbit-retry worker` loads neither the
operators' verbs nor what they import (rich, httpx; tests/unit/test_worker_imports.py).

Adding an option: a ``@click.option`` with click's types for the checks (``click.IntRange``,
``click.Choice``, ``click.Path(dir_okay=False)``...). `main` reports bad input as one line,
``error: --option: what is wrong``, exit 2; a check click cannot make raises ``InputError``
(rabbit_retry/errors.py) in the verb. A global option (accepted before or after the verb, like
``--url``) goes on ``cli`` and is read in ``pass_settings``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import click

from rabbit_retry.errors import EXIT_INPUT, EXIT_RUNTIME, RabbitRetryError
from rabbit_retry.settings import (
    CA_FILE_ENV,
    CERT_FILE_ENV,
    KEY_FILE_ENV,
    MANAGEMENT_URL_ENV,
    URL_ENV,
    Settings,
    mask,
)

PROG = "rabbit-retry"

# Each verb and the module of this package that defines it (in its COMMANDS).
VERBS = {
    "apply": "provision",
    "desk": "desk",
    "export": "provision",
    "migrate": "provision",
    "parking": "operate",
    "plan": "provision",
    "relay": "relay",
    "rescue": "operate",
    "status": "operate",
    "validate": "provision",
    "worker": "worker",
}

P = ParamSpec("P")
R = TypeVar("R")


class Group(click.Group):
    """A group whose help lists each verb with its ``short_help``, else the whole first
    paragraph of its help (click would cut it short), and whose unknown verb is one line that
    says where the verbs are."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None:
                summary = command.short_help or (command.help or "").split("\n\n")[0]
                rows.append((name, " ".join(summary.split())))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0]
        if not name.startswith("-") and self.get_command(ctx, name) is None:
            raise click.UsageError(
                f"no such command {name!r} ({ctx.command_path} --help lists them)", ctx
            )
        return super().resolve_command(ctx, args)


class _LazyVerbs(Group):
    """The verbs of ``VERBS``, each imported when it is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in VERBS:
            return None
        return commands_of(VERBS[cmd_name])[cmd_name]


def commands_of(module: str) -> dict[str, click.Command]:
    """The verbs rabbit_retry.cli.``module`` defines (imported now)."""
    commands: dict[str, click.Command] = importlib.import_module(
        f"rabbit_retry.cli.{module}"
    ).COMMANDS
    return commands


@click.group(cls=_LazyVerbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    envvar=URL_ENV,
    multiple=True,
    metavar="URL",
    help="AMQP URL; its path is the vhost. The nodes of a cluster: a comma-separated list or "
    "the option repeated, tried in order.",
)
@click.option(
    "--management-url",
    envvar=MANAGEMENT_URL_ENV,
    multiple=True,
    metavar="URL",
    help="HTTP management API URL; a list, like --url, for a cluster.",
)
@click.option(
    "--ca-file",
    envvar=CA_FILE_ENV,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="PEM CA certificate that signed the broker's (amqps:// and https://).",
)
@click.option(
    "--cert-file",
    envvar=CERT_FILE_ENV,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="PEM client certificate, for brokers that require one.",
)
@click.option(
    "--key-file",
    envvar=KEY_FILE_ENV,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="PEM private key of --cert-file (password, if any: RABBIT_RETRY_KEY_PASSWORD).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="rabbit-retry", prog_name=PROG)
def cli(**options: Any) -> None:
    """Broker-native retries for RabbitMQ: provision, consume, review what was parked."""
    # The connection settings are built when a verb runs (pass_settings), after its own
    # arguments are checked: `rabbit-retry worker --help` works with a bad RABBIT_RETRY_URL.


def pass_settings(verb: Callable[Concatenate[Settings, P], R]) -> Callable[P, R]:
    """``verb`` gets the ``Settings`` of the global options (and their environment variables;
    a list there may be separated by spaces or commas) as its first argument."""

    @functools.wraps(verb)
    def with_settings(*args: P.args, **kwargs: P.kwargs) -> R:
        options = click.get_current_context().find_root().params
        settings = Settings.from_env(
            options["url"],
            options["management_url"],
            ca_file=options["ca_file"],
            cert_file=options["cert_file"],
            key_file=options["key_file"],
        )
        return verb(settings, *args, **kwargs)

    return with_settings


def stdin_is_terminal() -> bool:
    """Whether a confirmation can be asked (replay, purge and migrate refuse otherwise)."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def confirm(question: str) -> None:
    """Asks ``question [y/N]: ``; returns on yes. No (the default), end of input or Ctrl-C raise
    ``click.Abort``, which `main` reports as "aborted", exit 2."""
    click.confirm(question, default=False, abort=True)


def _register() -> None:
    """Imports every verb's module (what `main` imports only for the verb it runs)."""
    for module in set(VERBS.values()):
        commands_of(module)


# The group's options, accepted after the verb too (`rabbit-retry apply F --url U`): no verb
# has an option of the same name, so moving them in front of the verb changes no meaning.
_GLOBALS = [p for p in cli.params if isinstance(p, click.Option) and not p.is_eager]
_GLOBAL_FLAGS = tuple(name for p in _GLOBALS if p.is_flag for name in p.opts)
_GLOBAL_WITH_VALUE = tuple(name for p in _GLOBALS if not p.is_flag for name in p.opts)


def hoist_global_options(args: list[str]) -> list[str]:
    """``args`` with the group's options moved in front, in order; nothing after ``--`` moves."""
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


def _check_last(args: list[str]) -> None:
    """A global option that ends the command line, with no value: hoisting left it behind,
    where the verb's parser would call it an unknown option."""
    if args and args[-1] in _GLOBAL_WITH_VALUE and "--" not in args:
        raise click.BadOptionUsage(args[-1], f"option {args[-1]!r} requires an argument")


def _param_name(param: click.Parameter) -> str:
    """How an error names ``param``: its long option, or an argument's metavar (``FILE``)."""
    if isinstance(param, click.Option):
        return next((o for o in param.opts if o.startswith("--")), param.opts[0])
    return param.human_readable_name.removesuffix("...")


def _one_line(exc: click.UsageError) -> str:
    """click's message as one line: ``--option: what is wrong``, lower case, no full stop."""
    param = exc.param if isinstance(exc, click.BadParameter) else None
    if param is not None and isinstance(exc, click.MissingParameter):
        return f"{_param_name(param)} is required"
    message = " ".join((exc.message if param else exc.format_message()).split()).rstrip(".")
    if message[:1].isupper() and not message[1:2].isupper():
        message = message[0].lower() + message[1:]
    return f"{_param_name(param)}: {message}" if param else message


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors, and the exit codes the README lists under "Commands"."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    if not debug:
        # The AMQP client logs each failed connect itself; we already say it in one line.
        for name in ("aiormq", "aio_pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PipeProof(sys.stdout), _PipeProof(sys.stderr)
    try:
        _check_last(args)
        with cli.make_context(PROG, hoist_global_options(args)) as ctx:
            cli.invoke(ctx)
        sys.stdout.flush()  # a closed pipe is seen here, not at exit
    except click.exceptions.Exit as exc:  # --help, --version
        sys.exit(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:  # no verb: the help, on stderr
        click.echo(exc.ctx.get_help(), err=True)
        sys.exit(EXIT_INPUT)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_INPUT)
    except click.UsageError as exc:
        if debug:
            _print_traceback()
        click.echo(f"error: {mask(_one_line(exc))}", err=True)
        sys.exit(EXIT_INPUT)
    except RabbitRetryError as exc:
        if debug:
            _print_traceback()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            click.echo(f"error: {mask(line)}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # written past _PipeProof (a stream kept from before main)
        _quiet_stdout()
        sys.exit(0)
    except Exception as exc:  # the last line of defence: one line, never a traceback
        if debug:
            _print_traceback()
        click.echo(
            f"error: unexpected {type(exc).__name__}: {mask(str(exc))} (run with --debug for "
            "details)",
            err=True,
        )
        sys.exit(EXIT_RUNTIME)
    finally:
        sys.stdout, sys.stderr = streams
    sys.exit(0)


class _PipeProof:
    """``stream`` (stdout or stderr) that a reader going away (`| head`) does not break: from
    the first closed-pipe error on, what is written goes nowhere and the verb runs on to its
    end and its own exit code. Every writer goes through it (click.echo, rich, print), so no
    verb handles a closed pipe itself (rich would exit 1 on its own)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._gone = True
        # What the stream still buffers goes to /dev/null, so the flush at exit is quiet too.
        with contextlib.suppress(OSError, ValueError):  # no file behind it (a test's capture)
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _quiet_stdout() -> None:
    """The reader of stdout went away (`| head`): what is left unwritten goes nowhere, and
    Python's flush at exit does not complain about it."""
    with contextlib.suppress(OSError, ValueError):  # no file behind stdout (a test's capture)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _print_traceback() -> None:
    import traceback

    # Masked too: a library's frame may show a URL.
    sys.stderr.write(mask(traceback.format_exc()))
