"""One fresh process per run of this same script (`--child` added), an environment switch set to
0 and 1 alternately, which goes first alternating round by round, so drift of the machine over the
run falls on both settings alike."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator


def alternating_runs(script: str, var: str, rounds: int) -> Iterator[tuple[int, str, str]]:
    """(round, "0" or "1", the child's last line of stdout) for each run, in the order run."""
    args = [sys.executable, script, *sys.argv[1:], "--child"]
    for r in range(rounds):
        for val in (("0", "1") if r % 2 == 0 else ("1", "0")):
            env = dict(os.environ, **{var: val})
            out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
            yield r, val, out.strip().splitlines()[-1]
