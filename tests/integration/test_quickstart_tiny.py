"""The quickstart launcher end to end on the tiny variant, with real processes.

`python -m services.controller run examples/quickstart-tiny.yaml` starts the
synchronizer, trainer and rollout as children, trains 10 GRPO steps over
exactly one epoch (40 questions, 4 per step), checkpoints every 2 steps.

- SIGKILL the launcher mid-run: its children die with it; the same command
  again finishes the run with continuous step numbers, every training question
  trained exactly once (per step, the last session's ledger line counts: steps
  after the last checkpoint are redone), and a final checkpoint that
  `from_pretrained` loads.
- Chaos: SIGKILL the synchronizer, the trainer or the rollout at a random
  step: the launcher heals the run by itself (launcher/healing.py) and exits 0,
  every question still trained exactly once in the final model's lineage.
  (The runs whose subject is the launcher alone put the rollout on the
  transformers engine: vLLM's start would be most of their time.)
- With restarts off, a dead trainer ends the run with exit 1, named, and no
  process it started is left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import psutil  # noqa: E402  (a dev dependency)

from flywheel.launcher.preloaded import PRELOADED_ENV
from flywheel.testing.engines import with_transformers_engine
from services.rollout.engine.vllm_sockets import PREFIX, room_for_sockets

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "quickstart-tiny.yaml"
STEPS, TASKS = 10, 40


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def launch(run_dir: Path, cache: Path, log_name: str, *extra: str, config: Path = CONFIG,
           fresh_interpreters: bool = False) -> subprocess.Popen:
    """`fresh_interpreters`: the services are started as a user's are, as the launcher's children (the
    suite's preloaded interpreter would start them: tests/preloaded.py), for the tests of that tree."""
    env = {**os.environ, "FLYWHEEL_MODEL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    if fresh_interpreters:
        env.pop(PRELOADED_ENV, None)
    out = open(run_dir.parent / log_name, "w")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(
        [sys.executable, "-m", "services.controller", "run", str(config), "--run-dir", str(run_dir), *extra],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )


def transformers_run_file(tmp_path: Path, serve_dtype: str = "same", **launch: object) -> Path:
    """The quickstart's run file with its rollout on the transformers engine (flywheel/testing/engines.py)
    and `launch` merged in: for the tests whose subject is the launcher, not the engine (vLLM takes most
    of a run's time here to start)."""
    config = with_transformers_engine(yaml.safe_load(CONFIG.read_text()))
    config["launch"].update(launch)
    config["launch"]["model"]["serve_dtype"] = serve_dtype
    path = tmp_path / "quickstart-transformers.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def vllm_run_file(tmp_path: Path) -> Path:
    """The quickstart's run file (vLLM) served as the SmolLM2 quickstart is: in bfloat16 where this machine
    has it natively (launch.model.serve_dtype auto), the trainer still training in float32."""
    config = yaml.safe_load(CONFIG.read_text())
    config["launch"]["model"]["serve_dtype"] = "auto"
    path = tmp_path / "quickstart-vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def assert_served_as_asked(run_dir: Path) -> None:
    """serve_dtype auto: the rollout held bfloat16 where the CPU has it natively (and the trainer published
    it), float32 elsewhere; every version it committed passed its verification (the probe included, held
    by the statistic that engine and dtype call for)."""
    from flywheel.models.precision import native_bfloat16

    rollout = yaml.safe_load((run_dir / "rollout.yaml").read_text())
    trainer = yaml.safe_load((run_dir / "trainer.yaml").read_text())
    served = "bfloat16" if native_bfloat16("cpu") else None
    assert rollout["engine"].get("args", {}).get("dtype") == trainer["model"].get("publish_dtype") == served
    events = [json.loads(line) for line in (run_dir / "rollout.log").read_text().splitlines()
              if line.startswith("{") and '"services.rollout.weights.transaction"' in line]
    assert not [e for e in events if e["msg"] == "weight update failed" and e.get("phase") == "verify"]
    committed = [e for e in events if e["msg"] == "weights committed"]
    assert max(e["version"] for e in committed) == STEPS
    # vLLM holds its probe's median in either dtype (its kernels are not the trainer's: single tokens
    # stray); the transformers engine, whose kernels are, the largest difference.
    held = "median" if rollout["engine"].get("kind", "auto") in ("vllm", "auto") else "max"
    probed = [e["coverage"] for e in committed if "probe of" in e["coverage"]]
    assert probed and all(f"probe of 60 tokens: {held} |diff|" in c and "passed" in c for c in probed), probed


def wait_for(what: str, ready: Callable[[], bool], timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_tasks.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # cut short by SIGKILL
    return rows


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_all_gone(procs: list[psutil.Process], timeout: float) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.cmdline()[:4]) for p in alive]}"


@pytest.mark.timeout(1800)
def test_sigkill_mid_run_then_the_same_command_resumes_and_finishes(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    # The subject is the launcher (chaos trial 2 runs vLLM); served as the quickstart is (serve_dtype auto).
    run_file = transformers_run_file(tmp_path, serve_dtype="auto")
    first = launch(run_dir, model_cache, "first.out", config=run_file, fresh_interpreters=True)
    try:
        # Step 3 trained means the step-2 checkpoint is written (checkpoints follow the step's record).
        wait_for("step 3", lambda: any(r["step"] >= 3 for r in ledger(run_dir)), 900, first)
        children = descendants(first.pid)
        assert {"synchronizer", "trainer", "rollout"} <= {
            arg.removeprefix("services.") for c in children for arg in c.cmdline()
        }
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        wait_all_gone(children, 90)  # PR_SET_PDEATHSIG: no orphans even after SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    killed_at = max(r["step"] for r in ledger(run_dir))
    assert killed_at < STEPS, "the run finished before it could be killed"

    first_session_log_lines = len((run_dir / "rollout.log").read_text().splitlines())
    second = launch(run_dir, model_cache, "second.out", config=run_file)
    assert second.wait(1200) == 0, (tmp_path / "second.out").read_text()[-3000:]
    assert_quiet_end((tmp_path / "second.out").read_text(), run_dir, vllm=False)

    rows = ledger(run_dir)
    sessions = list(dict.fromkeys(r["session"] for r in rows))
    assert len(sessions) == 2
    resumed = [r["step"] for r in rows if r["session"] == sessions[1]]
    # Same numbering: the second session continues right after a checkpoint of the first.
    assert resumed == list(range(resumed[0], STEPS + 1)), resumed
    assert resumed[0] <= killed_at + 1 and (resumed[0] - 1) % 2 == 0  # checkpoint interval 2
    assert_each_task_trained_once(rows)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == STEPS and summary["steps"] == STEPS
    assert summary["validation"]["before"] is not None and summary["validation"]["after"]["step"] == STEPS
    assert Path(summary["plot"]).is_file()
    # The final validation measured the final weights: the rollout got version 10 before it,
    # and no update of the second session failed (the first one's was cut by SIGKILL).
    second_session_log = (run_dir / "rollout.log").read_text().splitlines()[first_session_log_lines:]
    rollout_events = [json.loads(line) for line in second_session_log
                      if line.startswith("{") and '"services.rollout.weights.transaction"' in line]
    assert not [e for e in rollout_events if e["msg"] == "weight update failed"]
    assert max(e["version"] for e in rollout_events if e["msg"] == "weights committed") == STEPS
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary["model"])
    assert Path(summary["checkpoint"]).name == f"global_step_{STEPS}"
    assert next(model.parameters()).dtype == torch.float32, "the checkpoint is the trainer's float32 weights"
    assert_served_as_asked(run_dir)
    assert sum(p.numel() for p in model.parameters()) > 0


def assert_quiet_end(output: str, run_dir: Path, *, vllm: bool) -> None:
    """Nothing on the terminal after the run's summary but the services' exit lines, and no library's
    teardown noise at the end of a service's log (triton's nanobind leak report, ~30 lines a process:
    flywheel/runtime/triton_gate.py). With vLLM the rollout's log also holds what vLLM's own worker
    process prints, which still includes that report: that log is left out there."""
    lines = output.splitlines()
    summary = max(i for i, line in enumerate(lines) if line.startswith("summary: "))
    after = [line for line in lines[summary + 1:] if line.strip()]
    assert after and all(line.startswith("stopped ") for line in after), after
    for service in ("synchronizer", "trainer") + (() if vllm else ("rollout",)):
        log = (run_dir / f"{service}.log").read_text()
        assert "nanobind" not in log, f"{service}.log:\n{log[-1500:]}"


def assert_each_task_trained_once(rows: list[dict]) -> None:
    """The final model's lineage: per step, the last ledger line (a rewind redoes the steps after
    its checkpoint, and their later lines win) has every training question exactly once."""
    final = {r["step"]: r["tasks"] for r in rows}
    assert sorted(final) == list(range(1, STEPS + 1))
    trained = [task for step in sorted(final) for task in final[step]]
    assert len(trained) == len(set(trained)) == TASKS, "a question was trained twice or skipped"
    assert set(trained) == {f"train:0:{i}" for i in range(TASKS)}


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process started for this run (its services' command lines name the run directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def socket_dirs(pid: int) -> list[Path]:
    """The directories a vLLM replica's process `pid` holds its engine's sockets in (engine/vllm_sockets.py)."""
    return list(Path(tempfile.gettempdir()).glob(f"{PREFIX}{pid}-*"))


#: Chaos trials: CI runs 3 (one per service); `FLYWHEEL_CHAOS_TRIALS=20` for the full run.
CHAOS_TRIALS = int(os.environ.get("FLYWHEEL_CHAOS_TRIALS", "3"))
CHAOS_SEED = int(os.environ.get("FLYWHEEL_CHAOS_SEED", "0"))
#: A JSONL file each trial appends its outcome to, passed or failed (scripts/reliability_table.py
#: renders docs/reliability.md from it).
CHAOS_RECORD = os.environ.get("FLYWHEEL_CHAOS_RECORD", "")
VICTIMS = ("synchronizer", "trainer", "rollout")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("trial", range(CHAOS_TRIALS))
def test_chaos_a_service_sigkilled_at_a_random_step_heals_without_a_second_command(
    trial: int, tmp_path: Path, model_cache: Path
) -> None:
    """A service SIGKILLed at a random step: the launcher restarts it (a replica alone; the trainer
    or the synchronizer by rewinding every service to the last checkpoint), the one command exits 0,
    and every question of the epoch is trained exactly once in the final model's lineage."""
    rng = random.Random(CHAOS_SEED * 1000 + trial)
    victim = VICTIMS[trial] if trial < len(VICTIMS) else rng.choice(VICTIMS)
    kill_after = rng.randint(1, STEPS - 2)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    row: dict = {"seed": CHAOS_SEED, "trial": trial, "victim": victim, "killed_at": None, "exit": None,
                 "healed": False, "error": ""}
    try:
        # The rollout's death is healed by restarting its engine: vLLM, as the quickstart runs it. The
        # others are healed by the launcher rewinding every service; the engine plays no part there.
        vllm = victim == "rollout"
        config = vllm_run_file(tmp_path) if vllm else transformers_run_file(tmp_path)
        proc = launch(run_dir, model_cache, "launcher.out", config=config)
        try:
            wait_for(f"step {kill_after}", lambda: any(r["step"] >= kill_after for r in ledger(run_dir)), 900, proc)
            pid = json.loads((run_dir / f"{victim}.ready.json").read_text())["pid"]
            if vllm and room_for_sockets(Path(tempfile.gettempdir()), pid):
                # vLLM binds its sockets in the replica's own directory, not at the temp dir's top
                sockets = [s for d in socket_dirs(pid) for s in d.iterdir() if s.is_socket()]
                assert sockets, f"no socket directory of process {pid}"
            os.kill(pid, signal.SIGKILL)
            killed_at = row["killed_at"] = max(r["step"] for r in ledger(run_dir))
            code = row["exit"] = proc.wait(600)
        finally:
            if proc.poll() is None:
                proc.kill()
        output = (tmp_path / "launcher.out").read_text()
        print(f"chaos trial {trial}: {victim} SIGKILLed at step {killed_at}, exit {code}, "
              f"{time.monotonic() - started:.0f}s")
        assert killed_at < STEPS, "the run finished before it could be killed"
        assert code == 0, output[-3000:]
        assert f"healing: {victim} died (exit -9)" in output, output[-3000:]
        assert_each_task_trained_once(ledger(run_dir))
        assert_quiet_end(output, run_dir, vllm=vllm)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["last_step"] == STEPS
        [restart] = summary["restarts"]
        assert restart["service"] == victim and restart["exit_code"] == -9
        assert restart["action"] == ("restarted" if victim == "rollout" else "rewound")
        wait_all_gone(processes_of(run_dir), 30)
        if vllm:
            assert_served_as_asked(run_dir)
            # vLLM's socket files (engine/vllm_sockets.py): the killed replica's directory is removed by the
            # one that replaced it, and that one's as it exits. Nothing of either is left in the temp dir.
            replaced = json.loads((run_dir / f"{victim}.ready.json").read_text())["pid"]
            assert replaced != pid
            assert not socket_dirs(pid) and not socket_dirs(replaced)
        row["healed"] = True
    except BaseException as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise
    finally:
        row["seconds"] = round(time.monotonic() - started, 1)
        if CHAOS_RECORD:
            with open(CHAOS_RECORD, "a") as record:
                record.write(json.dumps(row) + "\n")


@pytest.mark.timeout(900)
def test_with_restarts_off_a_dead_trainer_stops_the_run_named_and_no_process_is_left(
    tmp_path: Path, model_cache: Path
) -> None:
    """`launch.restarts.max_restarts: 0`: the death of the trainer ends the run, named, with exit 1
    (the same command again resumes: the test above), and nothing the launcher started is left."""
    run_file = transformers_run_file(tmp_path, restarts={"max_restarts": 0})
    run_dir = tmp_path / "run"
    proc = launch(run_dir, model_cache, "launcher.out", config=run_file, fresh_interpreters=True)
    try:
        wait_for("step 1", lambda: any(r["step"] >= 1 for r in ledger(run_dir)), 900, proc)
        everything = descendants(proc.pid)
        trainer_pid = json.loads((run_dir / "trainer.ready.json").read_text())["pid"]
        os.kill(trainer_pid, signal.SIGKILL)
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (tmp_path / "launcher.out").read_text()
    assert code == 1, output[-3000:]
    assert "service trainer exited with code -9" in output, output[-3000:]
    assert "healing" not in output
    wait_all_gone(everything, 30)
