"""Errors a user can act on, each carrying its exit code (README, "Commands")."""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_INPUT = 2
EXIT_CONFLICT = 3
# `plan --detailed-exitcode`: apply has changes to make (2 is taken by invalid input).
EXIT_PENDING = 4


class RabbitRetryError(Exception):
    """An error shown to the user as one line; ``exit_code`` is what the CLI returns."""

    exit_code = EXIT_RUNTIME


class InputError(RabbitRetryError):
    """The file, the arguments or the usage are wrong; nothing was touched."""

    exit_code = EXIT_INPUT


class BrokerError(RabbitRetryError):
    """The broker is unreachable, refused us, or failed while we worked."""

    exit_code = EXIT_RUNTIME


class NodeDownError(BrokerError):
    """An object exists but its node is down or unreachable: waiting helps, apply would not."""


class ConflictError(RabbitRetryError):
    """The live broker disagrees with the file in a way we will not overwrite."""

    exit_code = EXIT_CONFLICT
