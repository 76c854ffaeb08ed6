"""Records a `make test` run (its junit XML) in bench/results/suite.jsonl.

    git clone -q . /tmp/clone && cd /tmp/clone
    start=$(date +%s); PYTEST_ADDOPTS=--junitxml=/tmp/suite.xml .ci/run; end=$(date +%s)
    python scripts/record_suite.py /tmp/suite.xml --with-setup-seconds $((end - start))
    # then, in the working copy: append the printed record's line, python scripts/performance_table.py

Run it in the checkout that ran the suite, on the machine that ran it: the record takes this
checkout's commit and this CPU (flywheel/testing/records.py). The counts and pytest's own time come
from the junit XML; --with-setup-seconds is the whole command's time (`.ci/run` also sets up .venv).
A run under conditions that differ from a plain 2-core machine (a CPU quota, kernels held to another
instruction set) says so with --conditions: the tables show it beside the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.testing.records import keep, make_record  # noqa: E402

PLAIN = "fresh clone, `.ci/run`, `-n 2`"


def figures(junit: Path, with_setup_seconds: float | None) -> dict[str, Any]:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise SystemExit(f"{junit}: no <testsuite> in it")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out: dict[str, Any] = {
        "tests": count["tests"],
        "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
        "failed": count["failures"], "errors": count["errors"], "skipped": count["skipped"],
        "pytest_minutes": round(max(float(s.get("time", 0)) for s in suites) / 60, 1),
    }
    if with_setup_seconds is not None:
        out["with_setup_minutes"] = round(with_setup_seconds / 60, 1)
    failed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    if failed:
        out["failed_tests"] = failed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path, help="the junit XML the run wrote (PYTEST_ADDOPTS=--junitxml=FILE)")
    parser.add_argument("--with-setup-seconds", type=float, help="the whole command's time, setup included")
    parser.add_argument("--how", default=PLAIN, help=f"how the suite ran (default: {PLAIN})")
    parser.add_argument("--conditions", help="what differed from a plain machine (a CPU quota, an imitated ISA)")
    parser.add_argument("--note", help="what a reader needs to read the figures right (failures and their fixes)")
    args = parser.parse_args()
    figs = {"how": args.how, **figures(args.junit, args.with_setup_seconds)}
    if args.conditions:
        figs["conditions"] = args.conditions
    rec = make_record("suite", figs, args={"junit": str(args.junit)}, note=args.note)
    print(json.dumps(rec))
    keep(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
