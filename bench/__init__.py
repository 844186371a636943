"""Side-by-side benchmarks of rabbit-retry against baselines run in the same process tree.

Their plumbing (publishing, queue depths, waiting, provisioning, throwaway vhosts, the command
line) is the tests' own package ``support`` (tests/support), found in ``tests/`` as pytest finds
it (pyproject's ``pythonpath``): importing ``bench`` puts ``tests/`` on ``sys.path``, however the
benchmarks are started (``python -m bench.run``, ``python bench/run.py``, a consumer process).
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
