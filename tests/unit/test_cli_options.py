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
        # A trailing option without its value stays where it is (main reports it).
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


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--url", "notaurl", "error: --url: expected an amqp:// or amqps:// URL, got 'notaurl'"),
        ("--url", "amqp://guest:secret@h:abc/",
         "error: --url: the port of 'amqp://guest:***@h:abc/' is not a number from 1 to 65535"),
        ("--url", "amqp://guest:secret@h:99999/",
         "error: --url: the port of 'amqp://guest:***@h:99999/' is not a number from 1 to 65535"),
        ("--management-url", "ftp://guest:secret@h",
         "error: --management-url: expected http(s)://user:pass@host:port, got "
         "'ftp://guest:***@h'"),
        ("--management-url", "http://guest:secret@h:abc",
         "error: --management-url: the port of 'http://guest:***@h:abc' is not a number from 1 "
         "to 65535"),
    ],
)
def test_a_malformed_url_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    # status reads the management API and the vhost of --url: both URLs are checked first.
    topology = tmp_path / "t.yml"
    topology.write_text("version: 1\nqueues:\n  q: {}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["status", str(topology), option, value])
    captured = capsys.readouterr()
    assert (exit_info.value.code, captured.out, captured.err) == (2, "", message + "\n")


def test_every_node_of_a_list_is_tried_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens on ports 1 and 2: both nodes are tried, in order, and both are named.
    with pytest.raises(SystemExit) as exit_info:
        main(["parking", "show", "q", "--url", "amqp://guest:secret@127.0.0.1:1/",
              "--url", "amqp://guest:secret@127.0.0.1:2/"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert err == (
        "error: no node of the cluster took the connection: broker at "
        "amqp://guest:***@127.0.0.1:1/ is unreachable: connection refused; broker at "
        "amqp://guest:***@127.0.0.1:2/ is unreachable: connection refused\n"
    ), err


def test_every_management_node_is_tried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = tmp_path / "t.yml"
    topology.write_text("version: 1\nqueues:\n  q: {}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["status", str(topology),
              "--management-url", "http://guest:secret@127.0.0.1:1,http://guest:secret@127.0.0.1:2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    # The last node tried is the one named; the password of none.
    assert "error: management API at http://127.0.0.1:2 unreachable" in err, err
    assert "secret" not in err
