"""Runs a bench in its --smoke mode, as CI does, and returns its closing JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(bench: str, timeout: float, *args: str) -> dict:
    """`bench/<bench>.py --smoke [args]` from the repository root; fails the test with the output's tail
    when it does not exit 0."""
    proc = subprocess.run([sys.executable, f"bench/{bench}.py", "--smoke", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
