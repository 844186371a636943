"""The group's connection options work before or after the verb, as users type them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rabbit_retry.cli import hoist_global_options, main


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["apply", "t.yml", "--url", "amqp://h/v"], ["--url", "amqp://h/v", "apply", "t.yml"]),
        (["apply", "--url=amqp://h/v", "t.yml"], ["--url=amqp://h/v", "apply", "t.yml"]),
        (
            ["--debug", "parking", "show", "Q", "--management-url", "http://m", "--limit", "3"],
            ["--debug", "--management-url", "http://m", "parking", "show", "Q", "--limit", "3"],
        ),
        (["worker", "m:C", "-t", "f.yml", "--debug"], ["--debug", "worker", "m:C", "-t", "f.yml"]),
        (["apply", "t.yml", "--", "--url", "x"], ["apply", "t.yml", "--", "--url", "x"]),
        # A trailing option without its value stays where it is, for click to report.
        (["apply", "t.yml", "--url"], ["apply", "t.yml", "--url"]),
        (["status", "--urlish", "x"], ["status", "--urlish", "x"]),
    ],
)
def test_hoisting(args: list[str], expected: list[str]) -> None:
    assert hoist_global_options(args) == expected


def test_url_after_the_verb_is_the_url_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens on port 1: the error names the URL given after the verb, password masked.
    topology = tmp_path / "t.yml"
    topology.write_text("version: 1\nqueues:\n  q: {}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["status", str(topology), "--management-url", "http://guest:secret@127.0.0.1:1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert "error: management API at http://127.0.0.1:1 unreachable" in err, err
    assert "secret" not in err
