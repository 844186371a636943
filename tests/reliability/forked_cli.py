"""Run many ``rabbit-retry`` command lines, each in its own process, without paying the command's
start-up (about 0.7 s of imports) every time: this driver imports the command once, then forks a
child per command line. Each child is a real process with its own stdout, stderr and exit status,
running the same entry point as the installed ``rabbit-retry`` script.

    python forked_cli.py JOBS.json RESULTS.json

JOBS.json is a list of argument lists; RESULTS.json gets ``[{"code", "out", "err"}, ...]`` in
the same order. Used by test_bad_topology.py for the 156 runs over the malformed corpus.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def run_one(args: list[str], workdir: str, index: int) -> int:
    """Fork a child that runs ``rabbit-retry ARGS`` with stdout/stderr in files; its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        out = os.open(os.path.join(workdir, f"{index}.out"), os.O_WRONLY | os.O_CREAT, 0o600)
        err = os.open(os.path.join(workdir, f"{index}.err"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(out, 1)
        os.dup2(err, 2)
        from rabbit_retry.cli import main

        sys.argv = ["rabbit-retry", *args]
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    jobs_path, results_path = sys.argv[1], sys.argv[2]
    with open(jobs_path) as f:
        jobs: list[list[str]] = json.load(f)
    import rabbit_retry.cli

    rabbit_retry.cli._register()  # every verb imported once, before forking
    codes: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as workdir:
        running: dict[int, int] = {}
        for index, args in enumerate(jobs):
            if len(running) >= 4:
                pid, status = os.wait()
                codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
            running[run_one(args, workdir, index)] = index
        while running:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        results = []
        for index in range(len(jobs)):
            with open(os.path.join(workdir, f"{index}.out")) as out, \
                    open(os.path.join(workdir, f"{index}.err")) as err:
                results.append({"code": codes[index], "out": out.read(), "err": err.read()})
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
