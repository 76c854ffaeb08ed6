"""Published figures are recorded figures: every bench keeps its closing JSON line as a record in
bench/results/, docs/performance.md and the README's tables (the quickstart, the suite) are generated from those
records (scripts/performance_table.py), and a figure either file shows must come from a record."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.testing import records

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "scripts" / "performance_table.py"
sys.path.insert(0, str(ROOT / "scripts"))
import performance_table as table  # noqa: E402

NUMBER = re.compile(r"\d+(?:\.\d+)?")
#: What reads as a measured figure in prose: durations, percentages, ratios (1.75x), fractions (0.42).
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|s|sec|seconds|min|minutes|h|hours)\b|\d+(?:\.\d+)?\s*%|"
                    r"\b\d+(?:\.\d+)?[x×]\b|(?<![\d.])0\.\d+(?![\d.])")


def run_generator(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_performance_page_and_the_readme_table_are_what_the_records_give() -> None:
    proc = run_generator("--check")
    assert proc.returncode == 0, proc.stderr


def _numbers(value: object) -> set[float]:
    """Every number of a record (figures, arguments, note), and each in milliseconds."""
    if isinstance(value, dict):
        return set().union(*(_numbers(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_numbers(v) for v in value)) if value else set()
    if isinstance(value, bool):
        return set()
    if isinstance(value, (int, float)):
        return {float(value), float(value) * 1000}
    return {float(n) for n in NUMBER.findall(str(value))}


def _unrecorded(shown: str, known: set[float]) -> list[str]:
    """The numbers in `shown` that are no rounding of a recorded one."""
    missing = []
    for token in NUMBER.findall(shown):
        places = len(token.partition(".")[2])
        half = 0.5 * 10 ** -places if places else 0.5
        if not any(abs(float(token) - v) <= half * (1 + 1e-9) for v in known):
            missing.append(token)
    return missing


def _rows(text: str) -> list[list[str]]:
    """The body rows of every markdown table in `text` (header and rule left out)."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and not line.startswith("|---") and i + 1 < len(lines) \
                and not lines[i + 1].startswith("|---"):
            out.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return out


def _recorded(commit_cell: str, by_commit: dict[str, list[dict]]) -> set[float]:
    sha = commit_cell.removesuffix(" (edited)")
    found = by_commit.get(sha)
    assert found, f"a published row names commit {sha!r}, which no record in bench/results has"
    return set().union(*(_numbers(r) for r in found))


def _by_commit() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rows in records.read(records.RESULTS).values():
        for r in rows:
            out.setdefault(r["commit"].removesuffix("-dirty")[:7], []).append(r)
    return out


def test_every_figure_docs_performance_publishes_is_in_a_record() -> None:
    by_commit = _by_commit()
    rows = _rows((ROOT / "docs" / "performance.md").read_text())
    assert rows
    for cells in rows:
        known = _recorded(cells[0], by_commit)  # commit, machine, then the figures
        missing = _unrecorded(" ".join(cells[2:]), known)
        assert not missing, f"docs/performance.md row {cells[:2]}: {missing} in no record of that commit"


def test_the_readme_publishes_figures_only_in_its_generated_tables() -> None:
    text = (ROOT / "README.md").read_text()
    spans = table.generated_spans(text)
    assert len(spans) == 2, "the README has a quickstart table and a suite table"
    by_commit = _by_commit()
    for start, end in spans:
        rows = _rows(text[start:end])
        assert rows, f"a generated README table shows no recorded run: {text[start:end][:80]}"
        for cells in rows:
            known = _recorded(cells[1], by_commit)  # CPU, commit, then the figures
            missing = _unrecorded(" ".join(cells[2:]), known)
            assert not missing, f"README row {cells[:2]}: {missing} in no record of that commit"
    rest = "".join(text[a:b] for a, b in zip([0] + [e for _, e in spans], [s for s, _ in spans] + [len(text)]))
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", rest, flags=re.S)  # commands and sample output are not figures
    for line in prose.splitlines():
        if line.startswith("|"):
            assert not NUMBER.search(line), f"a README table outside the generated ones shows numbers: {line}"
        assert not FIGURE.search(line), f"a figure in the README without a record (put it in a record): {line}"


def test_every_bench_ends_by_recording_its_figures() -> None:
    for path in sorted((ROOT / "bench").glob("*.py")):
        source = path.read_text()
        if 'if __name__ == "__main__":' not in source:
            continue  # a module the benches share (bench/quickstart_job.py), no bench of its own
        assert re.search(r"^from flywheel\.testing\.records import .*\brecord\b", source, re.M), path.name
        assert f'record("{path.stem}", ' in source, f"{path.name} does not record its closing line as {path.stem!r}"


def _fixed_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "machine", lambda: {"cpu_model": "Test CPU", "cpu_isa": "avx2",
                                                     "cpu_flags": ["avx2"], "cpu_cores": 2})


def test_a_real_run_appends_a_record_with_commit_cpu_date_and_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(records.ENV_DIR, str(tmp_path))
    figures = {"bench": "codec", "codec_vs_tcp_loopback": 1.25, "path": Path("/x")}
    records.record("codec", {"codec_vs_tcp_loopback": 1.25}, args={"size_mib": 512, "smoke": False, "out": Path("/x")})
    records.record("codec", figures, args=None)
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {**figures, "path": "/x"}  # the line, as before
    first, second = [json.loads(line) for line in (tmp_path / "codec.jsonl").read_text().splitlines()]
    assert first["bench"] == "codec" and first["figures"] == {"codec_vs_tcp_loopback": 1.25}
    assert first["args"] == {"size_mib": 512, "smoke": False, "out": "/x"} and first["smoke"] is False
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", first["commit"]), first["commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", first["date"])
    assert first["cpu_model"] and first["cpu_isa"] in {"amx", "avx512_bf16", "avx512", "avx2", "other"}
    assert set(first["cpu_flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert second["figures"]["path"] == "/x"


def test_a_smoke_run_keeps_no_record_in_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    _fixed_machine(monkeypatch)
    monkeypatch.delenv(records.ENV_DIR, raising=False)
    monkeypatch.setattr(records, "RESULTS", tmp_path / "results")
    records.record("codec", {"codec_vs_tcp_loopback": 1.0}, args={"smoke": True}, smoke=True)
    assert json.loads(capsys.readouterr().out.strip()) == {"codec_vs_tcp_loopback": 1.0}
    assert not (tmp_path / "results").exists()
    assert records.destination(smoke=True) is None and records.destination(smoke=False) == tmp_path / "results"
    monkeypatch.setenv(records.ENV_DIR, str(tmp_path / "elsewhere"))  # a test's own directory takes it
    records.record("codec", {"codec_vs_tcp_loopback": 1.0}, smoke=True)
    assert json.loads((tmp_path / "elsewhere" / "codec.jsonl").read_text())["smoke"] is True


def test_the_check_fails_until_a_new_record_is_published(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(records.RESULTS, results)
    out, readme = tmp_path / "performance.md", tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    shutil.copy(ROOT / "docs" / "performance.md", out)
    args = ("--results", str(results), "--out", str(out), "--readme", str(readme))
    assert run_generator("--check", *args).returncode == 0
    new = {"bench": "quickstart", "commit": "abcdef0123456789", "date": "2099-01-01T00:00:00Z", "cpu_model": "Test CPU",
           "cpu_isa": "amx", "cpu_flags": [], "cpu_cores": 2, "args": {}, "smoke": False,
           "figures": {"seed": 3, "validation": {"0": 0.295, "10": 0.612}, "val_before": 0.295, "val_after": 0.777,
                       "after_step": 30, "run_minutes": 9.5}}
    records.append(new, results)
    failed = run_generator("--check", *args)
    assert failed.returncode == 1 and "out of date" in failed.stderr
    assert run_generator(*args).returncode == 0
    assert run_generator("--check", *args).returncode == 0
    assert "| Test CPU, 2 cores, amx | abcdef0 | 3 | 0.295 | 0.612 | **0.777** (step 30) | 9.5 min |" in readme.read_text()
    assert "abcdef0" in out.read_text()


def test_a_quickstart_run_directory_becomes_a_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "quickstart-seed2"
    run_dir.mkdir()
    history = [{"step": 0, "value": 0.295}, {"step": 10, "value": 0.64}, {"step": 30, "value": 0.72}]
    (run_dir / "summary.json").write_text(json.dumps({
        "last_step": 30, "job_seconds_this_session": 600.0, "restarts": [],
        "validation": {"metric": "val/accuracy", "before": history[0], "after": history[-1], "history": history},
    }))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/step_seconds": 20.0 + s}) + "\n"
                                                   for s in range(1, 4)) + '{"step": 4, "cut')
    env = {**os.environ, records.ENV_DIR: str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_quickstart.py"), str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (rec,) = [json.loads(line) for line in (tmp_path / "results" / "quickstart.jsonl").read_text().splitlines()]
    assert rec["bench"] == "quickstart" and rec["smoke"] is False and rec["cpu_model"]
    assert rec["figures"] == {"seed": 2, "steps": 30, "validation": {"0": 0.295, "10": 0.64, "30": 0.72},
                              "val_before": 0.295, "val_after": 0.72, "after_step": 30, "run_minutes": 10.0,
                              "median_step_seconds": 22.0}


def test_the_quickstart_job_in_another_mode_is_recorded_with_its_mode_and_kept_out_of_the_readme(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "fully-async"
    run_dir.mkdir()
    history = [{"step": 0, "value": 0.295}, {"step": 30, "value": 0.7}]
    (run_dir / "summary.json").write_text(json.dumps({
        "last_step": 30, "job_seconds_this_session": 900.0,
        "validation": {"metric": "val/accuracy", "before": history[0], "after": history[-1], "history": history},
    }))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time/step_seconds": 30.0, "staleness/mean": m}) + "\n"
        for s, m in ((1, 0.0), (2, 3.0), (3, 4.5))))
    config = tmp_path / "fully-async.yaml"
    config.write_text("mode: fully-async\nstaleness: {policy: correct}\n")
    env = {**os.environ, records.ENV_DIR: str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_quickstart.py"), str(run_dir),
                           "--config", str(config)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (rec,) = [json.loads(line) for line in (tmp_path / "results" / "quickstart.jsonl").read_text().splitlines()]
    figs = rec["figures"]
    assert (figs["mode"], figs["staleness"], figs["mean_staleness"]) == ("fully-async", {"policy": "correct"}, 2.5)
    assert table.mode(rec) == "fully-async (policy correct)" and not table.ships_as_is(rec)
    shipped = {**rec, "figures": {k: v for k, v in figs.items() if k not in ("mode", "staleness")}}
    assert table.mode(shipped) == "sync" and table.ships_as_is(shipped)
    readme = table.readme_tables({"quickstart": [rec, shipped]})[table.BEGIN]
    assert readme.count(rec["commit"][:7]) == 1  # the shipped run's row alone


def test_a_suite_run_junit_becomes_a_record_the_tables_show(tmp_path: Path) -> None:
    junit = tmp_path / "suite.xml"
    junit.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        '<testsuite name="pytest" errors="1" failures="1" skipped="2" tests="10" time="1260.5">'
        '<testcase classname="tests.unit.test_a" name="test_ok" time="1.0" />'
        '<testcase classname="tests.unit.test_a" name="test_broken" time="2.0"><failure message="x">x</failure></testcase>'
        '<testcase classname="tests.unit.test_b" name="test_setup" time="0.1"><error message="y">y</error></testcase>'
        '</testsuite></testsuites>')
    env = {**os.environ, records.ENV_DIR: str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_suite.py"), str(junit),
                           "--with-setup-seconds", "1400", "--conditions", "a CPU quota of 1.38 cores"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (rec,) = [json.loads(line) for line in (tmp_path / "results" / "suite.jsonl").read_text().splitlines()]
    assert rec["bench"] == "suite" and rec["cpu_model"] and re.fullmatch(r"[0-9a-f]{40}(-dirty)?", rec["commit"])
    figs = rec["figures"]
    assert (figs["tests"], figs["passed"], figs["failed"], figs["errors"], figs["skipped"]) == (10, 6, 1, 1, 2)
    assert (figs["pytest_minutes"], figs["with_setup_minutes"]) == (21.0, 23.3)
    assert figs["failed_tests"] == ["tests.unit.test_a::test_broken", "tests.unit.test_b::test_setup"]
    row = dict(zip([h for h, _ in table.README_SUITE_COLUMNS], [cell(rec) for _, cell in table.README_SUITE_COLUMNS]))
    assert row["CPU"].endswith("; a CPU quota of 1.38 cores")
    assert row["tests"] == "6 passed, 1 failed, 1 errors, 2 skipped"
    assert row["time"] == "**21.0 min** (23.3 with setup)"


def test_the_readme_shows_the_newest_quickstart_runs_of_each_cpu_and_no_more() -> None:
    def run(cpu: str, day: int) -> dict:
        return {"bench": "quickstart", "commit": f"{day:040x}", "date": f"2026-11-{day:02d}T00:00:00Z",
                "cpu_model": cpu, "cpu_isa": "avx2", "cpu_cores": 2, "figures": {"seed": 0}}

    runs = [run("AMD EPYC", d) for d in range(1, 6)] + [run("Intel Xeon", d) for d in (2, 9)]
    kept = table.newest_per_cpu(runs, 3)
    assert [(r["cpu_model"], r["date"][8:10]) for r in kept] == [
        ("Intel Xeon", "09"), ("Intel Xeon", "02"), ("AMD EPYC", "05"), ("AMD EPYC", "04"), ("AMD EPYC", "03")]
    shown = table.readme_tables({"quickstart": runs})[table.BEGIN]
    assert shown.count("| AMD EPYC, ") == 3 and shown.count("| Intel Xeon, ") == 2
