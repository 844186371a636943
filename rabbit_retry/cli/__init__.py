"""The ``rabbit-retry`` command: a click group; each verb lives in a sibling module."""

from __future__ import annotations

import importlib
import logging
import sys
import traceback

import click

from rabbit_retry.errors import EXIT_INPUT, EXIT_RUNTIME, RabbitRetryError
from rabbit_retry.settings import Settings, mask

# Each verb's module, imported when that verb is looked up: `rabbit-retry worker` does not load
# the operators' verbs and what they import (rich, httpx).
_VERBS = {"status": "operate", "parking": "operate", "validate": "provision", "plan": "provision",
          "apply": "provision", "export": "provision", "migrate": "provision",
          "worker": "worker", "desk": "desk"}


class _LazyVerbs(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_VERBS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _VERBS:
            importlib.import_module(f"rabbit_retry.cli.{_VERBS[cmd_name]}")
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyVerbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    envvar="RABBIT_RETRY_URL",
    multiple=True,
    help="AMQP URL; its path is the vhost. The nodes of a cluster: a comma-separated list or "
    "the option repeated, tried in order.",
)
@click.option(
    "--management-url",
    envvar="RABBIT_RETRY_MANAGEMENT_URL",
    multiple=True,
    help="HTTP management API URL; a list, like --url, for a cluster.",
)
@click.option(
    "--ca-file",
    envvar="RABBIT_RETRY_CA_FILE",
    type=click.Path(dir_okay=False),
    help="PEM CA certificate that signed the broker's (amqps:// and https://).",
)
@click.option(
    "--cert-file",
    envvar="RABBIT_RETRY_CERT_FILE",
    type=click.Path(dir_okay=False),
    help="PEM client certificate, for brokers that require one.",
)
@click.option(
    "--key-file",
    envvar="RABBIT_RETRY_KEY_FILE",
    type=click.Path(dir_okay=False),
    help="PEM private key of --cert-file (password, if any: RABBIT_RETRY_KEY_PASSWORD).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="rabbit-retry")
@click.pass_context
def cli(
    ctx: click.Context,
    url: tuple[str, ...],
    management_url: tuple[str, ...],
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    debug: bool,
) -> None:
    """Broker-native retries for RabbitMQ: provision, consume, review what was parked."""
    ctx.obj = Settings.from_env(
        url, management_url, ca_file=ca_file, cert_file=cert_file, key_file=key_file
    )


def settings_of(ctx: click.Context) -> Settings:
    obj = ctx.find_root().obj
    assert isinstance(obj, Settings)
    return obj


def _register() -> None:
    # Verbs register themselves on import; `main` imports only the one it runs (_LazyVerbs).
    from rabbit_retry.cli import desk, operate, provision, worker  # noqa: F401


# The group's options, accepted after the verb too (`rabbit-retry apply F --url U`): no verb
# has an option of the same name, so moving them in front of the verb changes no meaning.
_GLOBAL_WITH_VALUE = ("--url", "--management-url", "--ca-file", "--cert-file", "--key-file")
_GLOBAL_FLAGS = ("--debug",)


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


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors, and the exit codes the README lists under "Commands"."""
    args = hoist_global_options(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if not debug:
        # The AMQP client logs each failed connect itself; we already say it in one line.
        for name in ("aiormq", "aio_pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        cli.main(args=args, prog_name="rabbit-retry", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_INPUT)
    except click.ClickException as exc:
        if debug:
            traceback.print_exc()
        exc.show()
        sys.exit(EXIT_INPUT if exc.exit_code in (1, 2) else exc.exit_code)
    except RabbitRetryError as exc:
        if debug:
            traceback.print_exc()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            click.echo(f"error: {mask(line)}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # the last line of defence: one line, never a traceback
        if debug:
            traceback.print_exc()
        click.echo(
            f"error: unexpected {type(exc).__name__}: {mask(str(exc))} (run with --debug for "
            "details)",
            err=True,
        )
        sys.exit(EXIT_RUNTIME)
    sys.exit(0)
