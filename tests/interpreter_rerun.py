"""Re-run a test file's own tests in a child pytest with Triton's CPU interpreter switched on.

The parent run tests the torch path; the child (env flag set) takes the Triton path of the same
tests. The child must pass and report exactly `expected` passed tests, so a skip-all child fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def rerun_under_interpreter(test_file: str, flag: str, select: str, expected: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", flag: "1"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert re.search(rf"^{expected} passed", p.stdout, re.M), p.stdout[-500:]
