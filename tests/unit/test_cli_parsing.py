"""The command line itself (click): bad input is one line and exit 2, help and version, the
confirmation prompt, a closed pipe. Nothing here reaches a broker."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from rabbit_retry.cli import VERBS, commands_of, confirm, main
from rabbit_retry.errors import EXIT_INPUT


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    code = exit_info.value.code
    assert isinstance(code, int)
    return code, out, err


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["worker", "m:C"], "error: --topology is required"),
        (["worker", "-t", "t.yml"], "error: MODULE:CLASS is required"),
        (["worker"], "error: MODULE:CLASS is required"),
        (["worker", "m:C", "-t"], "error: option '-t' requires an argument"),
        (["worker", "m:C", "-t", "t.yml", "--metrics-port", "70000"],
         "error: --metrics-port: 70000 is not in the range 0<=x<=65535"),
        (["worker", "m:C", "-t", "t.yml", "--metrics-port", "-1"],
         "error: --metrics-port: -1 is not in the range 0<=x<=65535"),
        (["worker", "m:C", "-t", "t.yml", "--metrics-port", "x"],
         "error: --metrics-port: 'x' is not a valid integer range"),
        (["worker", "m:C", "-t", "t.yml", "--grace", "-1"],
         "error: --grace: -1.0 is not in the range x>=0"),
        (["worker", "m:C", "-t", "t.yml", "--grace", "soon"],
         "error: --grace: 'soon' is not a valid float range"),
        (["worker", "m:C", "-t", "t.yml", "--log-level", "loud"],
         "error: --log-level: 'loud' is not one of 'debug', 'info', 'warning', 'error'"),
        (["export", "t.yml"], "error: --format is required"),
        (["export", "t.yml", "--format", "dot"],
         "error: --format: 'dot' is not one of 'definitions', 'mermaid', 'alerts', 'grafana'"),
        (["parking", "show", "q", "--limit", "0"], "error: --limit: 0 is not in the range x>=1"),
        (["parking", "replay", "q", "--rate", "0"],
         "error: --rate: 0.0 is not in the range x>0"),
        (["parking", "export", "q"], "error: --out is required"),
        (["parking", "show"], "error: QUEUE is required"),
        (["parking", "peek", "q"],
         "error: no such command 'peek' (rabbit-retry parking --help lists them)"),
        (["status"], "error: FILE is required"),
        (["validate", "t.yml", "--nope"], "error: no such option '--nope'"),
        (["validate", "a.yml", "b.yml"], "error: got unexpected extra argument (b.yml)"),
        (["deploy"], "error: no such command 'deploy' (rabbit-retry --help lists them)"),
        (["--nope", "validate", "t.yml"], "error: no such option '--nope'"),
        (["validate", "t.yml", "--url"], "error: option '--url' requires an argument"),
        # Long options are never abbreviated.
        (["worker", "m:C", "-t", "t.yml", "--metrics", "1"],
         "error: no such option '--metrics'. (Did you mean one of: '--metrics-addr',"
         " '--metrics-port'?)"),
        # A password given where it does not belong is masked like everywhere else.
        (["validate", "t.yml", "amqp://guest:secret@h/"],
         "error: got unexpected extra argument (amqp://guest:***@h/)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    assert _run(capsys, *args) == (EXIT_INPUT, "", line + "\n")


def test_a_traceback_only_with_debug(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--debug", "worker", "m:C", "-t", "t.yml", "--grace", "x")
    assert (code, out) == (EXIT_INPUT, "")
    assert err.startswith("Traceback (most recent call last):\n"), err
    assert err.endswith("\nerror: --grace: 'x' is not a valid float range\n"), err


def test_a_directory_where_a_file_is_expected(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    here = str(tmp_path)
    for args, name in ((["status", here], "FILE"), (["desk", here], "FILE"),
                       (["worker", "m:C", "-t", here], "--topology"),
                       (["export", "t.yml", "--format", "mermaid", "--out", here], "--out"),
                       (["--ca-file", here, "status", "t.yml"], "--ca-file")):
        assert _run(capsys, *args) == (
            EXIT_INPUT, "", f"error: {name}: file {here!r} is a directory\n")


def test_help_lists_every_verb_with_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--help")
    assert (code, err) == (0, "")
    assert out.startswith("Usage: rabbit-retry [OPTIONS] COMMAND [ARGS]...\n")
    listed = " ".join(out.split("\nCommands:\n", 1)[1].split())
    for name, module in VERBS.items():
        # The whole first paragraph of the verb's own help: click would cut it short.
        help_text = commands_of(module)[name].help or ""
        summary = " ".join(help_text.split("\n\n")[0].split())
        assert f"{name} {summary}" in listed, name
    assert "Prometheus alerting rules or a Grafana dashboard for its queues; touches no broker"\
        in listed
    for option in ("--url", "--management-url", "--ca-file", "--cert-file", "--key-file",
                   "--debug", "--version", "-h, --help"):
        assert option in out


def test_each_verb_has_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["worker"], ["parking"], ["parking", "replay"], ["desk"], ["apply"]):
        code, out, err = _run(capsys, *args, "-h")
        assert (code, err) == (0, ""), args
        assert out.startswith(f"Usage: rabbit-retry {' '.join(args)} "), out
    code, out, _ = _run(capsys, "parking", "--help")
    assert "\nCommands:\n  export  Write parked messages to a JSON-lines file.\n" in out
    assert "\n  show    Peek at parked messages; they stay parked.\n" in out
    code, out, _ = _run(capsys, "worker", "--help")
    assert "--grace SECONDS" in out and "[default: 30.0; x>=0]" in " ".join(out.split())


def test_no_verb_shows_the_help_on_stderr_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys)
    assert (code, out) == (EXIT_INPUT, "")
    assert err.startswith("Usage: rabbit-retry [OPTIONS] COMMAND [ARGS]...\n")
    code, out, err = _run(capsys, "--debug", "parking")
    assert (code, out) == (EXIT_INPUT, "")
    assert err.startswith("Usage: rabbit-retry parking [OPTIONS] COMMAND [ARGS]...\n")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert _run(capsys, "--version") == (0, f"rabbit-retry, version {version('rabbit-retry')}\n",
                                         "")


def test_a_list_in_the_environment_may_be_separated_by_spaces(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens on ports 1 and 2: both nodes of the variable are tried, in order.
    monkeypatch.setenv("RABBIT_RETRY_URL",
                       "amqp://guest:secret@127.0.0.1:1/ amqp://guest:secret@127.0.0.1:2/")
    code, out, err = _run(capsys, "parking", "show", "q")
    assert (code, out) == (1, "")
    assert "127.0.0.1:1/ is unreachable" in err and "127.0.0.1:2/ is unreachable" in err, err
    assert "secret" not in err


@pytest.mark.parametrize(("typed", "yes"), [("y\n", True), ("yes\n", True), ("Y\n", True),
                                             ("n\n", False), ("\n", False), ("", False),
                                             ("maybe\ny\n", True), ("maybe\n", False)])
def test_confirm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, typed: str, yes: bool
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(typed))
    if yes:
        confirm("Replay 2?")
    else:
        with pytest.raises(click.Abort):
            confirm("Replay 2?")
    out = capsys.readouterr().out
    assert out.startswith("Replay 2? [y/N]: ")
    assert ("Error: invalid input" in out) == typed.startswith("maybe")


def test_a_help_works_with_a_bad_url_in_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The settings are built when a verb runs, after its own arguments.
    monkeypatch.setenv("RABBIT_RETRY_URL", "bad")
    code, out, err = _run(capsys, "worker", "--help")
    assert (code, err) == (0, "") and out.startswith("Usage: rabbit-retry worker ")
    assert _run(capsys, "parking", "show", "q") == (
        EXIT_INPUT, "", "error: --url: expected an amqp:// or amqps:// URL, got 'bad'\n")


def test_output_piped_to_head_ends_quietly(tmp_path: Path) -> None:
    # Far more lines than a pipe holds: the reader goes away while the command still writes.
    topology = tmp_path / "big.yml"
    topology.write_text("version: 1\nqueues:\n" + "".join(f"  q{i}: {{}}\n" for i in range(2000)))
    command = [sys.executable, "-c", "from rabbit_retry.cli import main; main()", "validate",
               str(topology)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        first = process.stdout.readline()
        process.stdout.close()
        err = process.stderr.read()
    assert first == f"{topology}: valid; 2000 exchanges, 10000 queues, 8000 bindings\n".encode()
    # The reader going away is no failure: the verb runs to its end and its own exit code.
    assert (process.returncode, err) == (0, b"")


@pytest.mark.parametrize("args", [
    ("export", "{file}", "--format", "definitions"),
    ("export", "{file}", "--format", "mermaid"),
    ("export", "{file}", "--format", "alerts"),
    ("export", "{file}", "--format", "grafana"),
    ("validate", "{file}"),
    ("--help",),
    ("plan", "--help"),
], ids=lambda a: "-".join(a).replace("{file}", "").replace("--", "-"))
def test_every_verb_writing_into_a_closed_pipe_ends_quietly(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    # Both ends closed before the command writes a byte: every write meets a closed pipe.
    topology = tmp_path / "t.yml"
    topology.write_text("version: 1\nqueues:\n" + "".join(f"  q{i}: {{}}\n" for i in range(50)))
    argv = [a.replace("{file}", str(topology)) for a in args]
    out_read, out_write = os.pipe()
    os.close(out_read)
    done = subprocess.run([sys.executable, "-c", "from rabbit_retry.cli import main; main()",
                           *argv], stdout=out_write, stderr=subprocess.PIPE, check=False)
    os.close(out_write)
    assert (done.returncode, done.stderr) == (0, b"")


def test_an_error_into_a_closed_pipe_keeps_its_exit_code(tmp_path: Path) -> None:
    # Positive control for the one above: the closed pipe hides nothing but the text.
    for stream in ("stdout", "stderr"):
        read, write = os.pipe()
        os.close(read)
        target = {stream: write}
        done = subprocess.run([sys.executable, "-c", "from rabbit_retry.cli import main; main()",
                               "validate", str(tmp_path / "missing.yml")], check=False,
                              **{"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
                                 **target})
        os.close(write)
        assert done.returncode == EXIT_INPUT, stream
