"""What the desk refuses, as the API answers it: one line and an HTTP status.

    InputError (rabbit_retry.errors)
     └── DeskError        400  bad input
          ├── NotFound    404  no such message, group, replay or rule
          ├── Nothing     409  the action selects nothing it could act on (no audit entry)
          └── TooMany     429  too many failed logins
"""

from __future__ import annotations

from rabbit_retry.errors import InputError


class DeskError(InputError):
    status = 400


class NotFound(DeskError):
    status = 404


class Nothing(DeskError):
    """An action whose selection holds nothing it may act on: said, and nothing written."""

    status = 409


class TooMany(DeskError):
    status = 429

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after
