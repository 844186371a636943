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


def test_the_worker_path_imports_neither_the_terminal_nor_the_http_libraries() -> None:
    """An idle worker's memory is its imports (docs/worker-benchmark.md): the worker's start
    path must not pull in what only the operators' commands use."""
    import subprocess
    import sys

    code = ("import sys, rabbit_retry.cli, rabbit_retry.cli.worker, rabbit_retry.worker;"
            "print(sorted(m for m in ('rich', 'httpx', 'psycopg', 'redis') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"
