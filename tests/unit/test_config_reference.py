"""docs/configuration.md is generated from the config models: it must say what the code does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_reference_is_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
