"""The public API: what ``rabbit_retry`` exports, and what a user's type checker learns."""

from __future__ import annotations

from pathlib import Path

import mypy.api

import rabbit_retry

CASES = Path(__file__).parent / "typing_cases"


def test_every_name_in_all_is_importable() -> None:
    for name in rabbit_retry.__all__:
        assert getattr(rabbit_retry, name) is not None, name
    assert rabbit_retry.HandlerTimeout.__mro__[1] is TimeoutError
    assert repr(rabbit_retry.NOT_DECODED) == "NOT_DECODED"


def test_a_type_checker_learns_the_payload_type_and_the_run_options() -> None:
    out, _err, _code = mypy.api.run(
        ["--strict", "--no-incremental", "--cache-dir=/dev/null", "--hide-error-context",
         str(CASES / "typed_payload.py")]
    )
    assert 'Revealed type is "typed_payload.Order"' in out, out
    assert 'Revealed type is "Any"' in out, out
    assert 'Unexpected keyword argument "graze"' in out, out
    # Nothing else is wrong in the file: no complaint about the blocking handler's override.
    assert out.count("error:") == 1, out
