"""``python -m bench.run --only KEY`` rewrites only KEY's section and summary row of an existing
report: the other sections, their plots and what was written by hand stay."""

from __future__ import annotations

from bench.run import splice

EXISTING = """\
# Benchmarks

Written by `python -m bench.run` on 2026-11-21 19:58 UTC; the benchmarks took 18.3 minutes.

## Setup

- Machine: Old CPU, 2 CPUs (nproc).
- Broker: RabbitMQ 3.10.8 on Erlang 25.2.3, on the same machine (127.0.0.1).

## Summary

| benchmark | figures | goal | met |
|---|---|---|---|
| Worker | ratio: 1.2 | ratio >= 0.9 | yes |
| Batch (run 2026-11-28) | ratio: 3.7 (a note by hand) | ratio >= 5 | no |

## 1. Worker

**ratio: 1.2**

A paragraph written by hand.

![Worker](benchmarks-worker-0.png)

## 2. Batch

**ratio: 3.7**

Why the aim is not met, by hand.
"""

REPORT = """\
# Benchmarks

Written by `python -m bench.run --only batch,ordered` on 2026-11-29 06:01 UTC; 2 minutes.

## Setup

- Machine: New CPU, 2 CPUs (nproc).
- Broker: RabbitMQ 4.3.6 on Erlang 27, on the same machine (127.0.0.1).
- Each benchmark's own settings are listed in its section.

## Summary

| benchmark | figures | goal | met |
|---|---|---|---|
| Batch | ratio: 4.1 | ratio >= 5.0 | no |
| Ordered | ratio: 0.9 | ratio >= 0.8 | yes |

## 1. Batch

**ratio: 4.1**

- Wall time 91 s, finished 2026-11-29 06:01 UTC.

![Batch](benchmarks-batch-0.png)

## 2. Ordered

**ratio: 0.9**

- Wall time 60 s, finished 2026-11-29 06:03 UTC.
"""


def test_only_the_run_benchmarks_sections_and_rows_change() -> None:
    out = splice(EXISTING, REPORT)
    assert out.startswith(EXISTING.split("| Batch (run")[0])  # header, setup, the worker's row
    assert "| Worker | ratio: 1.2 | ratio >= 0.9 | yes |\n| Batch | ratio: 4.1 |" in out
    assert "| Ordered | ratio: 0.9 | ratio >= 0.8 | yes |\n\n## 1. Worker" in out
    assert "A paragraph written by hand.\n\n![Worker](benchmarks-worker-0.png)" in out
    assert "3.7" not in out and "Why the aim is not met" not in out
    batch = out.split("## 2. Batch\n", 1)[1].split("\n## ", 1)[0]
    assert batch == (
        "\n**ratio: 4.1**\n\n- Wall time 91 s, finished 2026-11-29 06:01 UTC.\n"
        "- Written by `python -m bench.run --only batch,ordered` on 2026-11-29 06:01 UTC, by "
        "itself: Machine: New CPU, 2 CPUs (nproc). Broker: RabbitMQ 4.3.6 on Erlang 27, on the "
        "same machine (127.0.0.1).\n\n![Batch](benchmarks-batch-0.png)\n"
    )
    assert out.endswith("## 3. Ordered\n\n**ratio: 0.9**\n\n- Wall time 60 s, finished "
                        "2026-11-29 06:03 UTC.\n- Written by `python -m bench.run --only "
                        "batch,ordered` on 2026-11-29 06:01 UTC, by itself: Machine: New CPU, "
                        "2 CPUs (nproc). Broker: RabbitMQ 4.3.6 on Erlang 27, on the same "
                        "machine (127.0.0.1).\n")


def test_splicing_the_same_run_twice_changes_nothing_more() -> None:
    once = splice(EXISTING, REPORT)
    assert splice(once, REPORT) == once


def test_a_section_from_the_end_of_the_run_keeps_its_blank_line_before_the_next() -> None:
    worker = REPORT.split("## 1. Batch")[0] + "## 1. Worker\n\n**ratio: 1.3**\n"
    out = splice(EXISTING, worker)
    assert "## 1. Worker\n\n**ratio: 1.3**\n\n- Written by" in out
    assert "(127.0.0.1).\n\n## 2. Batch\n\n**ratio: 3.7**" in out
    assert out.endswith("Why the aim is not met, by hand.\n")
