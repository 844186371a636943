"""``rabbit-retry desk --listen``: what it accepts."""

import pytest

from rabbit_retry.desk.serve import Listen, parse_listen
from rabbit_retry.errors import InputError


def test_a_host_and_port_and_port_zero_for_one_the_system_picks() -> None:
    assert parse_listen("127.0.0.1:8025") == Listen("127.0.0.1", 8025)
    assert parse_listen("[::1]:8025") == Listen("::1", 8025)
    assert parse_listen("127.0.0.1:0") == Listen("127.0.0.1", 0)


@pytest.mark.parametrize("value", ["nowhere", "127.0.0.1:", ":8025", "127.0.0.1:65536",
                                   "127.0.0.1:-1", "127.0.0.1:http"])
def test_anything_else_is_one_line_naming_it(value: str) -> None:
    with pytest.raises(InputError) as refused:
        parse_listen(value)
    assert str(refused.value) == (f"--listen {value!r}: expected HOST:PORT, e.g. "
                                  "127.0.0.1:8025")
