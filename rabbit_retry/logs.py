"""How rabbit-retry's long-running commands log: one line per event, as text or as JSON.

``--log-format json`` writes one JSON object per line (what Loki, Elasticsearch and Cloud
Logging take as they are): ``time`` (UTC, ISO-8601), ``level``, ``logger``, ``message``, and the
fields the worker attaches to its decisions and events (``queue``, ``message_id``, ``attempt``,
``outcome``, ``reason``, ``exception_type``, ``exception_message``, ``event``...). Bodies are never
logged. Passwords never appear: every message is masked (``settings.mask``) on the way out.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

from rabbit_retry.settings import mask

Format = Literal["text", "json"]
FORMATS: tuple[Format, ...] = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# What every LogRecord carries: anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json  # loaded by the first record: a worker logging text never needs it

        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": mask(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value if isinstance(value, int | float | bool | None) else str(value)
        if record.exc_info:
            entry["traceback"] = mask(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


class _Masked(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return mask(super().format(record))


def configure(level: str = "info", fmt: Format = "text") -> None:
    """Log to stderr at ``level`` in ``fmt``; client libraries' chatter only at debug.

    aiormq and aio-pika log a lost connection with a traceback and every closed channel; the
    worker says each outage once, in one line of its own.
    """
    root = logging.getLogger()
    # Logging someone else set up (an application running the command in-process, a test
    # runner) stays as it is, as ``logging.basicConfig`` leaves it.
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if fmt == "json" else _Masked(TEXT))
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    if level != "debug":
        for name in ("aiormq", "aio_pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
