"""Whether a NOT_FOUND from a passive declare means the object does not exist, or that the node
holding it is down; pure.

RabbitMQ answers both with NOT_FOUND (404). Seen on a 4.3.6 cluster (Khepri) with a classic
queue's node killed, after about a minute of the broker's own retries: ``failed to perform
operation on queue 'q' in vhost '/' due to timeout``; 3.x and 4.0 (Mnesia) say at once ``home
node 'n' of durable queue 'q' in vhost '/' is down or inaccessible`` (rabbit_amqqueue.erl,
priv_absent, which also has ``... process is stopped by supervisor`` and ``... has crashed and
failed to restart``). A queue or
exchange that does not exist is ``no queue 'q' in vhost '/'`` (``no exchange ...``) on every
version. Only that form is read as missing: anything else may be an outage, which waiting cures
and ``rabbit-retry apply`` would not.
"""

from __future__ import annotations

import re

_MISSING = re.compile(r"\bno (queue|exchange) '.*' in vhost '.*'")


def is_missing(reply_text: str) -> bool:
    """True when a NOT_FOUND reply says the object does not exist (rather than: unreachable)."""
    return _MISSING.search(reply_text) is not None
