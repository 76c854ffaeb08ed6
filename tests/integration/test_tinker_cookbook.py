"""Thinking Machines' Tinker cookbook (tinker-cookbook==0.6.1 with tinker==0.38.0, unmodified,
requirements/tinker-cookbook.txt) runs its recipes against `flywheel up --with tinker` on the tiny
model, as a user runs them (docs/tinker.md, "The cookbook"):

- math_rl (env=arithmetic, importance_sampling, role_colon) runs for two tenants at once, each on its own
  key (made with `python -m flywheel.runtime.tokens tenant add`): each samples and trains its steps (one
  30, the other 3 beside it) and exits 0, its runs and saves under its own tenant, its saves for the
  sampler served as adapters side by side, and each model leaves at most K unnamed saves for the sampler
  on disk (the gateway's sampler_keep_unnamed, 2 here);
- chat_sl on the cookbook's example conversations, saving every 2 steps, is cut (SIGKILL) once its
  first periodic save is on record; run again with behavior_if_log_dir_exists=resume it goes on from
  that save with the optimizer state, while the cut run's session is still live (nothing finished
  it), saves periodically again and exits 0;
- DPO (`tinker_cookbook.preference.train_dpo.main`, driven by tests/integration/tinker_dpo.py on a local
  comparisons file through the cookbook's JSONL comparisons builder): its reference is the model's
  weights at the start, saved for the sampler and scored there (compute_logprobs), its loss a custom
  one (forward_backward_custom: a forward, the loss's gradient in the client, a weighted backward);
  it trains its steps and exits 0;
- on-policy distillation (`tinker_cookbook.distillation.train_on_policy.main`, driven by
  tests/integration/tinker_distillation.py on a local prompts file through the cookbook's own
  PromptOnlyDataset): the student samples, a teacher (a checkpoint saved for the sampler, its own
  sampling client) scores the student's tokens with compute_logprobs, and the student trains on the
  per-token reverse KL; it trains its steps and exits 0;
- every run that ended closed its session with reason "success": the gateway retired its model for
  that reason (its log's "model retired");
- nothing but loopback is contacted. The services and the recipes run in a network namespace with
  nothing but loopback where the test can make one (root, iproute2: CI), and always under an audit
  hook (tests/integration/loopback_only) that refuses and records any other destination: the
  cookbook's pricing file (fetched at start, the recipe goes on without it) must be the only one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.service_processes import log_tail, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GUARD = Path(__file__).resolve().parent / "loopback_only"
#: The services' own token (the recipes never see it: they send their tenant's key).
SERVICE_KEY = "tml-cookbook-service-token"
#: Unnamed saves for the sampler a model keeps (math_rl makes one a step).
KEEP_UNNAMED = 2
#: The one destination off loopback a recipe may try, and is refused: the pricing file it fetches at start.
PRICING_HOST = "tinker-docs.thinkingmachines.ai"


def cookbook_file(*parts: str) -> Path:
    spec = importlib.util.find_spec("tinker_cookbook")
    assert spec is not None and spec.submodule_search_locations, \
        "tinker-cookbook is not installed: pip install --no-deps -r requirements/tinker-cookbook.txt"
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def jsonl(path: Path) -> list[dict]:
    """A recipe's JSON lines file, without a last line still being written."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def loopback_namespace() -> tuple[str | None, str]:
    """A network namespace whose only interface is loopback (up), or None and why there is none."""
    if os.geteuid() != 0:
        return None, "not root"
    if shutil.which("ip") is None:
        return None, "no `ip` command (iproute2)"
    name = f"fwcook-{secrets.token_hex(4)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return None, f"ip netns add failed: {made.stderr.strip()}"
    up = subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        return None, f"ip link set lo up failed: {up.stderr.strip()}"
    return name, ""


@dataclass
class Deployment:
    """`flywheel up --with tinker` and how to run things beside it."""

    url: str
    base_model: str
    run_dir: Path
    work: Path
    env: dict[str, str]
    prefix: list[str]  # runs a command in the namespace (empty: none could be made)
    refused_log: Path
    keys: dict[str, str]  # tenant -> its key

    def tinker_dir(self, tenant: str) -> Path:
        return self.run_dir / "checkpoints" / "tinker" / tenant

    def recipe(self, name: str, log_path: Path, *args: str, tenant: str = "alice",
               command: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
        """Starts `python -m tinker_cookbook.recipes.<name>.train` (or `command`) against the gateway, on
        `tenant`'s key; its output file."""
        output = self.work / f"{log_path.name}-{sum(1 for _ in self.work.glob(log_path.name + '-*.out'))}.out"
        command = [*self.prefix, sys.executable, *(command or [
            "-m", f"tinker_cookbook.recipes.{name}.train", f"model_name={self.base_model}", f"base_url={self.url}",
            "renderer_name=role_colon", f"log_path={log_path}", *args])]
        with open(output, "wb") as out:
            process = subprocess.Popen(command, cwd=self.work, env={**self.env, "TINKER_API_KEY": self.keys[tenant]},
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return process, output

    def run_recipe(self, name: str, log_path: Path, *args: str, timeout: float = 240,
                   command: list[str] | None = None) -> str:
        """Runs a recipe (or `command`) to its end; its output, once it exited 0."""
        return self.run_recipes(name, {"alice": log_path}, *args, timeout=timeout, command=command)["alice"]

    def run_recipes(self, name: str, log_paths: dict[str, Path], *args: str, timeout: float = 240,
                    command: list[str] | None = None, own_args: dict[str, tuple[str, ...]] | None = None
                    ) -> dict[str, str]:
        """Runs the recipe for each tenant at once, each on its own key (with `own_args` of its own); their
        outputs, once all exited 0."""
        started = {tenant: self.recipe(name, path, *args, *(own_args or {}).get(tenant, ()), tenant=tenant,
                                       command=command)
                   for tenant, path in log_paths.items()}
        deadline = time.monotonic() + timeout
        for tenant, (process, output) in started.items():
            try:
                code = process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other, _ in started.values():
                    other.kill()
                    other.wait()
                raise AssertionError(f"{name} ({tenant}) did not finish in {timeout:.0f} s{log_tail(output)}") from None
            assert code == 0, f"{name} ({tenant}) exited {code}{log_tail(output, 60)}"
        return {tenant: output.read_text(errors="replace") for tenant, (_, output) in started.items()}

    def retired(self) -> dict[str, str]:
        """The gateway's "model retired" log lines: model id -> why (a model ends with its session)."""
        return {entry["model_id"]: entry["reason"] for entry in jsonl_lenient(self.run_dir / "tinker.log")
                if entry.get("msg") == "model retired"}

    def assert_closed_with_success(self, model_id: str) -> None:
        """The session of `model_id` was closed by its client with reason "success" (the first reason stays)."""
        why = wait_for(lambda: self.retired().get(model_id), 30, f"model {model_id} to be retired")
        assert why == "its session finished (success)", (model_id, why)

    def refused(self) -> list[dict]:
        """Every destination off loopback that a process tried, and was refused."""
        return jsonl(self.refused_log)


def jsonl_lenient(path: Path) -> list[dict]:
    """A service log's JSON lines (anything else a library printed there is skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    work = tmp_path_factory.mktemp("cookbook")
    namespace, why_not = loopback_namespace()
    if namespace is None:
        warnings.warn(f"no loopback-only network namespace ({why_not}): the audit hook alone keeps the recipes "
                      "and services on loopback, and sockets made by C code (gRPC's core) go unchecked", stacklevel=1)
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    refused_log = work / "refused.jsonl"
    # The services' token and two tenants' keys, made as an operator makes them.
    tokens = work / "tokens.yaml"
    tokens.write_text(f"service: {SERVICE_KEY}\n")
    keys = {}
    for tenant in ("alice", "bob"):
        made = subprocess.run([sys.executable, "-m", "flywheel.runtime.tokens", "tenant", "add", tenant, str(tokens)],
                              capture_output=True, text=True, timeout=60, check=True)
        keys[tenant] = made.stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLYWHEEL_", "TINKER_"))}
    env.update(
        FLYWHEEL_TOKENS_FILE=str(tokens),  # every service's token; the gateway admits the tenants' keys
        FLYWHEEL_TINKER__SAMPLER_KEEP_UNNAMED=str(KEEP_UNNAMED),
        FLYWHEEL_MODEL_CACHE=str(work / "models"),  # the tiny model and its untied copy, made here
        FLYWHEEL_LOOPBACK_LOG=str(refused_log),
        PYTHONPATH=os.pathsep.join(filter(None, [str(GUARD), os.environ.get("PYTHONPATH")])),
    )
    up_output = work / "up.out"
    with open(up_output, "wb") as out:
        up = subprocess.Popen([*prefix, sys.executable, "-m", "flywheel.cli", "up", "--with", "tinker",
                               "--tinker-port", "0", "--status-port", "0", "--run-dir", str(work / "runs")],
                              cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        line = wait_for(lambda: re.search(
            r"Tinker API: TINKER_BASE_URL=(\S+) \(base_model (\S+)\)", up_output.read_text(errors="replace")),
            300, "the Tinker API", up, up_output)
        run_dir = Path(re.search(r"\(logs in (\S+)\)", up_output.read_text()).group(1))
        yield Deployment(url=line.group(1), base_model=line.group(2), run_dir=run_dir, work=work, env=env,
                         prefix=prefix, refused_log=refused_log, keys=keys)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # flywheel up stops its services and exits
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        if namespace:
            # Anything still in the namespace was started here (a recipe a failed test left running).
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def model_of(tinker_path: str) -> str:
    match = re.fullmatch(r"tinker://([^/]+)/(?:weights|sampler_weights)/[^/]+", tinker_path)
    assert match, f"{tinker_path} is not a tinker:// path of a save"
    return match.group(1)


def assert_only_the_pricing_file_was_refused(deployment: Deployment, output: str) -> None:
    refused = deployment.refused()
    assert refused, "the recipe's pricing fetch was not seen: is the audit hook on the PYTHONPATH?"
    assert {(r["event"], r["host"]) for r in refused} == {("socket.getaddrinfo", PRICING_HOST)}, refused
    assert all("tinker_cookbook" in r["program"] for r in refused), refused  # none from a service
    assert f"Could not fetch model pricing from https://{PRICING_HOST}" in output


def assert_nothing_off_loopback_but_the_pricing_file(deployment: Deployment) -> None:
    """For a program that does not fetch the pricing file itself (the other recipes' refusals are in the
    same log): every destination off loopback any program tried is that file."""
    assert {r["host"] for r in deployment.refused()} <= {PRICING_HOST}, deployment.refused()


def test_math_rl_of_two_tenants_at_once_samples_and_trains_each_on_its_own(deployment: Deployment) -> None:
    log_paths = {tenant: deployment.work / f"math_rl-{tenant}" for tenant in ("alice", "bob")}
    # Alice runs 30 steps (30 saves for the sampler, of which at most KEEP_UNNAMED stay), bob 3 beside her.
    max_steps = {"alice": 30, "bob": 3}
    outputs = deployment.run_recipes(
        "math_rl", log_paths, "env=arithmetic", "loss_fn=importance_sampling", "groups_per_batch=2",
        "group_size=2", "max_tokens=4", "eval_every=0", "save_every=0",
        own_args={tenant: (f"max_steps={steps}",) for tenant, steps in max_steps.items()})
    models = {}
    for tenant, log_path in log_paths.items():
        assert "Training completed successfully" in outputs[tenant]
        trained = [row for row in jsonl(log_path / "metrics.jsonl") if "step:max" in row]
        # Each step sampled its groups on the gateway's sampler (2 groups of 2) and took one optimizer step.
        assert [row["step"] for row in trained] == list(range(max_steps[tenant]))
        assert all(row["env/all/total_episodes"] == 4 for row in trained), trained
        steps = [row["step:max"] for row in trained]
        assert steps == [steps[0] + i for i in range(max_steps[tenant])], steps
        (final,) = jsonl(log_path / "checkpoints.jsonl")
        assert final["name"] == "final"
        models[tenant] = model_of(final["state_path"])
        deployment.assert_closed_with_success(models[tenant])
        assert_only_the_pricing_file_was_refused(deployment, outputs[tenant])
    for tenant, model in models.items():
        # Each tenant's run and saves are under its own directory, none under the other's.
        other = next(t for t in models if t != tenant)
        assert (deployment.tinker_dir(tenant) / model / "run.json").is_file()
        assert not (deployment.tinker_dir(other) / model).exists()
        # One unnamed save for the sampler a step, at most KEEP_UNNAMED of them left on disk.
        sampler = deployment.run_dir / "checkpoints" / "sampler" / tenant / model
        unnamed = [p for p in sampler.glob("save-*/version_*/tinker.json") if json.loads(p.read_text())["name"] is None]
        assert 1 <= len(unnamed) <= KEEP_UNNAMED, unnamed


def test_chat_sl_cut_after_a_save_resumes_from_it_with_the_optimizer_state(deployment: Deployment) -> None:
    log_path = deployment.work / "chat_sl"
    steps, every = 6, 2
    args = (f"dataset={cookbook_file('example_data', 'conversations.jsonl')}", "batch_size=8", "max_length=256",
            f"save_every={every}", "eval_every=0", f"max_steps={steps}")
    first, first_output = deployment.recipe("chat_sl", log_path, *args)
    try:
        # Cut it once its first periodic save is on record (checkpoints.jsonl gets a line once the save is done).
        wait_for(lambda: jsonl(log_path / "checkpoints.jsonl"), 240, "chat_sl's first periodic save", first,
                 first_output)
    finally:
        first.kill()  # no goodbye: its session stays live on the gateway until its heartbeats time out
        first.wait()
    before = jsonl(log_path / "checkpoints.jsonl")
    cut = before[-1]  # the save it resumes from: the first (or, on a slow poll, a later periodic one)
    assert cut["name"] == f"{cut['batch']:06d}" and cut["batch"] % every == 0 and cut["epoch"] == 0, before
    cut_model = model_of(cut["state_path"])

    output = deployment.run_recipe("chat_sl", log_path, *args, "behavior_if_log_dir_exists=resume")
    # It made its model from the cut run's save, with the optimizer state (the gateway serves no other load) ...
    assert f"Resumed training from {cut['state_path']}" in output
    assert "Training completed successfully" in output
    trained = [row for row in jsonl(log_path / "metrics.jsonl") if "step:max" in row]
    # ... went on at the save's step, the cut run's rows from there on dropped ...
    assert [row["step"] for row in trained] == list(range(steps)), trained
    # ... and the trainer's optimizer went on from the save's step (a fresh optimizer counts from 1 again).
    record = json.loads((deployment.tinker_dir("alice") / cut_model / cut["name"] / "tinker.json").read_text())
    assert [row["step:max"] for row in trained[cut["batch"]:]] == \
        [record["step"] + k for k in range(1, steps - cut["batch"] + 1)], (record, trained)
    # It saved periodically again, and at the end, as a model of its own.
    resumed = jsonl(log_path / "checkpoints.jsonl")[len(before):]
    assert [r["name"] for r in resumed] == [f"{s:06d}" for s in range(cut["batch"], steps, every)] + ["final"], resumed
    (resumed_model,) = {model_of(r["state_path"]) for r in resumed}
    assert resumed_model != cut_model
    deployment.assert_closed_with_success(resumed_model)
    # The cut run never said goodbye: its model stays until its session times out (and then not for "success").
    assert deployment.retired().get(cut_model) != "its session finished (success)"
    assert_only_the_pricing_file_was_refused(deployment, output)


def comparisons_file(path: Path, n: int = 16) -> Path:
    """Sums, each with its right answer preferred to a wrong one (the cookbook's LabeledComparison rows)."""
    rows = []
    for i in range(n):
        a, b = i % 7 + 1, i % 5 + 2
        right, wrong = {"role": "assistant", "content": str(a + b)}, {"role": "assistant", "content": str(a + b + 3)}
        rows.append({"comparison": {"prompt_conversation": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                    "completion_A": [right] if i % 2 else [wrong],
                                    "completion_B": [wrong] if i % 2 else [right]},
                     "label": "A" if i % 2 else "B"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_cookbooks_dpo_trainer_runs_on_a_local_comparisons_file(deployment: Deployment) -> None:
    log_path = deployment.work / "dpo"
    comparisons = comparisons_file(deployment.work / "comparisons.jsonl")
    steps = 3
    output = deployment.run_recipe("dpo", log_path, timeout=300, command=[
        str(Path(__file__).resolve().parent / "tinker_dpo.py"), deployment.url, deployment.base_model,
        str(log_path), str(comparisons), str(steps)])
    trained = [row for row in jsonl(log_path / "metrics.jsonl") if "dpo_loss" in row or "loss" in row]
    assert len(trained) == steps, trained
    assert all(math.isfinite(row.get("dpo_loss", row.get("loss"))) for row in trained), trained
    assert "DPO training completed successfully" in output
    assert_nothing_off_loopback_but_the_pricing_file(deployment)


def test_the_cookbooks_on_policy_distillation_learns_from_a_teacher_checkpoint(deployment: Deployment) -> None:
    log_path = deployment.work / "distillation"
    prompts = deployment.work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + {i + 1}?"}) + "\n" for i in range(8)))
    steps = 2
    output = deployment.run_recipe("distillation", log_path, timeout=300, command=[
        str(Path(__file__).resolve().parent / "tinker_distillation.py"), deployment.url, deployment.base_model,
        str(log_path), str(prompts), str(steps)])
    trained = [row for row in jsonl(log_path / "metrics.jsonl") if "step" in row and any("kl" in k for k in row)]
    assert len(trained) == steps, jsonl(log_path / "metrics.jsonl")
    kls = [v for row in trained for k, v in row.items() if "teacher_kl" in k or k.endswith("/kl")]
    assert kls and all(math.isfinite(v) for v in kls), trained
    assert "teacher checkpoint: tinker://" in output
    assert_nothing_off_loopback_but_the_pricing_file(deployment)
