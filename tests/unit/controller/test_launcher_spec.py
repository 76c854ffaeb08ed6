"""The launch section and the resume shorthands of a run file."""

from __future__ import annotations

import pytest

from services.controller.launcher.prepare import prepare_data
from services.controller.launcher.spec import DatasetSpec, resume_section, split_run_file
from flywheel.runtime.config import ConfigError


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("auto", {"from": "latest"}),
        ("disable", {"from": "none"}),
        ({"from_path": "/ck/global_step_4"}, {"from": "/ck/global_step_4"}),
        ({"from": "latest"}, {"from": "latest"}),
        (None, {"from": "none"}),
    ],
)
def test_resume_shorthands(given, expected):
    assert resume_section(given) == expected


def test_resume_of_the_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match="resume"):
        resume_section(3)


def test_split_defaults_to_resume_auto_and_removes_the_launch_section():
    spec, data = split_run_file({"launch": {"model": {"source": "tiny"}}, "run": {"name": "x"}}, "test")
    assert spec.model.source == "tiny"
    assert "launch" not in data and data["resume"] == {"from": "latest"}


def test_a_misspelt_launch_field_is_named():
    with pytest.raises(ConfigError, match=r"launch\.model\.sorce"):
        split_run_file({"launch": {"model": {"sorce": "tiny"}}}, "test")


def test_prepare_data_fills_generated_paths_only_when_none_are_given(tmp_path):
    data = prepare_data(DatasetSpec(train_size=8, validation_size=4), {"train": {"prompt_key": "question"}}, tmp_path)
    assert data["train"]["path"] == str(tmp_path / "train.jsonl")
    assert data["validation"]["shuffle"] is False
    assert (tmp_path / "validation.jsonl").read_text().count("\n") == 4
    own = {"train": {"path": "mine.jsonl"}}
    assert prepare_data(DatasetSpec(), own, tmp_path / "other") == own
    assert not (tmp_path / "other").exists()


def test_trainer_and_rollout_register_under_the_names_the_controller_uses(tmp_path):
    from services.controller.launcher.local_run import ROLLOUT_ID, LocalRun
    from services.controller.run_config import ServicesConfig
    from services.rollout.config import RolloutConfig
    from services.trainer.config import TrainerConfig

    spec, data = split_run_file({"launch": {"model": {"source": "tiny"},
                                            "rollout": {"synchronizer": {"retry_max_seconds": 5}}}}, "test")
    run = LocalRun(spec=spec, data=data, run_dir=tmp_path)
    run.model_dir = tmp_path / "model"
    configs = run.service_configs("127.0.0.1:4242")
    trainer = TrainerConfig.model_validate(configs["trainer"]).sync
    rollout = RolloutConfig.model_validate(configs["rollout"]).synchronizer
    assert (trainer.synchronizer_address, trainer.trainer_id) == ("127.0.0.1:4242", ServicesConfig().trainer_id)
    assert (rollout.address, rollout.component_id) == ("127.0.0.1:4242", ROLLOUT_ID)
    assert rollout.retry_max_seconds == 5  # the run file's launch section still wins


def test_local_services_take_paths_from_the_run_directory_and_the_checkpoint_resumed(tmp_path, monkeypatch):
    from services.controller.launcher.local_run import LocalRun
    from services.rollout.config import RolloutConfig
    from services.trainer.files import request_roots
    from services.trainer.config import TrainerConfig

    monkeypatch.chdir(tmp_path)
    spec, data = split_run_file({"resume": {"from_path": "old/checkpoints/global_step_4"}}, "test")
    run = LocalRun(spec=spec, data=data, run_dir=tmp_path / "run")
    run.model_dir = tmp_path / "model"
    configs = run.service_configs("127.0.0.1:4242")
    # Made absolute here: the trainer takes a relative request path inside its own checkpoint directory.
    assert run.data["resume"] == {"from": str(tmp_path / "old/checkpoints/global_step_4")}
    trainer = TrainerConfig.model_validate(configs["trainer"])
    assert tmp_path / "old/checkpoints" in request_roots(trainer)
    assert RolloutConfig.model_validate(configs["rollout"]).updates.checkpoint_root == tmp_path / "run"


def test_run_variables_override_the_run_files_fields(tmp_path):
    from argparse import Namespace

    from services.controller.launcher.local_run import LocalRun

    run_file = tmp_path / "run.yaml"
    run_file.write_text("run: {name: r}\nsync: {method: memory, interval: 2}\n")
    env = {
        "FLYWHEEL_RUN__SYNC__METHOD": "nccl",
        "FLYWHEEL_RUN__SERVICES": "{synchronizer: {address: 'sync:50051'}}",
        "FLYWHEEL_RUN__RUN__MAX_STEPS": "7",
        "FLYWHEEL_TRAINER__MODEL__PATH": "/elsewhere",  # another service's variable: not the run's
    }
    args = Namespace(config=run_file, max_steps=None, resume=None, seed=None, run_dir=tmp_path / "out")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        run = LocalRun.from_args(args)
    assert run.data["sync"] == {"method": "nccl", "interval": 2}  # merged, not replaced
    assert run.data["services"] == {"synchronizer": {"address": "sync:50051"}}
    assert run.data["run"]["max_steps"] == 7


@pytest.mark.parametrize("name", ["FLYWHEEL_RUN__SYNC__METHD", "FLYWHEEL_RUN__SYNC__METHOD__X", "FLYWHEEL_RUN__NOPE"])
def test_a_run_variable_naming_no_field_is_an_error(name):
    from services.controller.launcher.spec import run_env_overrides

    with pytest.raises(ConfigError, match=name):
        run_env_overrides({name: "1"})


def _named_run(tmp_path, timeout: float):
    from argparse import Namespace

    from services.controller.launcher.local_run import LocalRun

    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "run: {name: r}\nmodel: {name: m}\ndata: {train: {items: [{question: q, answer: a}]}}\n"
        f"launch: {{ready_timeout_seconds: {timeout}}}\n"
        "services: {synchronizer: {address: 'sync:1'}, trainer: {address: 'trainer:2'}}\n")
    args = Namespace(config=run_file, max_steps=None, resume=None, seed=None, run_dir=tmp_path / "out")
    return LocalRun.from_args(args)


def test_named_services_are_waited_for_until_serving(tmp_path, monkeypatch):
    """A deployed controller may start before the pods it drives have loaded their models."""
    import io

    import flywheel.runtime.health as health
    from services.controller.launcher.deployed import Deployment

    answers = {"sync:1": ["UNAVAILABLE", "SERVING"], "trainer:2": ["UNAVAILABLE", "NOT_SERVING", "SERVING"]}
    asked = []

    async def fake_check(address, service="", timeout=5.0):
        asked.append(address)
        return answers[address].pop(0)

    registrations = ["the synchronizer lists []", "registered"]

    async def fake_registration(deployment):
        asked.append("registration")
        return registrations.pop(0)

    monkeypatch.setattr(health, "check_health", fake_check)
    monkeypatch.setattr(Deployment, "trainer_registration", fake_registration)
    monkeypatch.setattr("services.controller.launcher.deployed.time.sleep", lambda s: None)
    run = _named_run(tmp_path, 60)
    run.out = io.StringIO()
    cfg = run.start_services()
    assert cfg.services.trainer.address == "trainer:2"
    # Health first; the trainer's registration once both serve.
    assert asked == ["sync:1", "trainer:2", "sync:1", "trainer:2", "trainer:2", "registration", "registration"]
    assert "waiting for synchronizer (sync:1), trainer (trainer:2) to report SERVING" in run.out.getvalue()


def test_a_trainer_never_registering_times_out_naming_its_settings(tmp_path, monkeypatch):
    """A trainer pointed at the wrong synchronizer serves, but publishes nothing: the run must not wait forever."""
    import flywheel.runtime.health as health
    from services.controller.launcher.deployed import Deployment

    async def serving(address, service="", timeout=5.0):
        return "SERVING"

    async def unregistered(deployment):
        return "the synchronizer lists ['rollout-a-50053']"

    monkeypatch.setattr(health, "check_health", serving)
    monkeypatch.setattr(Deployment, "trainer_registration", unregistered)
    run = _named_run(tmp_path, 0.01)
    run.say = lambda text: None
    with pytest.raises(TimeoutError, match=r"trainer 'trainer-0' never registered .* sync.synchronizer_address"):
        run.start_services()


def test_a_named_service_never_serving_times_out_naming_it(tmp_path, monkeypatch):
    import flywheel.runtime.health as health

    async def fake_check(address, service="", timeout=5.0):
        return "SERVING" if address == "sync:1" else "UNAVAILABLE"

    monkeypatch.setattr(health, "check_health", fake_check)
    run = _named_run(tmp_path, 0.01)
    run.say = lambda text: None
    with pytest.raises(TimeoutError, match=r"trainer at trainer:2: UNAVAILABLE"):
        run.start_services()


def test_a_decaying_learning_rate_decays_over_the_runs_steps_unless_told_otherwise(tmp_path):
    from services.controller.launcher.local_run import LocalRun
    from services.trainer.config import TrainerConfig

    def optimizer(trainer_section):
        spec, data = split_run_file({"run": {"max_steps": 30}, "launch": {"trainer": trainer_section}}, "test")
        run = LocalRun(spec=spec, data=data, run_dir=tmp_path)
        run.model_dir = tmp_path / "model"
        return TrainerConfig.model_validate(run.service_configs("127.0.0.1:4242")["trainer"]).optimizer

    assert optimizer({"optimizer": {"schedule": "linear"}}).total_steps == 30
    assert optimizer({"optimizer": {"schedule": "cosine", "total_steps": 50}}).total_steps == 50  # named: kept
    assert optimizer({"optimizer": {"lr": 1e-5}}).total_steps == 0  # constant: nothing to decay over


@pytest.mark.parametrize("modules", [["q_proj", "lm_head"], ["q_proj"]], ids=["head adapted", "head not adapted"])
def test_a_lora_on_the_output_head_of_a_tied_model_trains_an_untied_copy(tmp_path, modules):
    from flywheel.models.tiny import build_tiny_model
    from flywheel.models.untie import ties_embeddings
    from services.controller.launcher.local_run import LocalRun

    tied = build_tiny_model(tmp_path / "tiny")
    assert ties_embeddings(tied)
    spec, data = split_run_file({
        "launch": {"model": {"source": "path", "path": str(tied)}, "dataset": {"train_size": 4, "validation_size": 2},
                   "trainer": {"model": {"lora": {"enabled": True, "target_modules": modules}}}},
        "data": {"train": {"prompt_key": "question"}}}, "test")
    run = LocalRun(spec=spec, data=data, run_dir=tmp_path / "run", out=open(tmp_path / "out.txt", "w"))
    run.prepare()
    # The merged adapter makes a head of its own: a tied served model has no room for it (every update
    # would be refused), so the services load an untied copy, made once beside the model.
    assert run.model_dir == (tmp_path / "tiny-untied" if "lm_head" in modules else tied)
    assert not ties_embeddings(run.model_dir) or "lm_head" not in modules


@pytest.mark.parametrize(("serve", "native", "served"), [("same", True, "float32"), ("bfloat16", False, "bfloat16"),
                                                         ("auto", True, "bfloat16"), ("auto", False, "float32")])
def test_the_rollout_serves_the_dtype_the_trainer_publishes(tmp_path, monkeypatch, serve, native, served):
    import flywheel.models.precision as precision
    from services.controller.launcher.local_run import LocalRun
    from services.rollout.config import RolloutConfig
    from services.trainer.config import TrainerConfig

    monkeypatch.setattr(precision, "native_bfloat16", lambda device: native)
    spec, data = split_run_file({"launch": {"model": {"source": "tiny", "serve_dtype": serve}}}, "test")
    run = LocalRun(spec=spec, data=data, run_dir=tmp_path)
    run.model_dir = tmp_path / "model"
    configs = run.service_configs("127.0.0.1:4242")
    trainer = TrainerConfig.model_validate(configs["trainer"]).model
    rollout = RolloutConfig.model_validate(configs["rollout"]).engine
    assert trainer.dtype == "float32"  # trains in the stored dtype whatever it serves
    assert (trainer.publish_dtype or trainer.dtype) == rollout.args.get("dtype", "float32") == served


def test_a_dtype_said_twice_and_differently_is_refused(tmp_path):
    from services.controller.launcher.local_run import LocalRun

    for section in ({"rollout": {"engine": {"args": {"dtype": "float32"}}}},
                    {"trainer": {"model": {"publish_dtype": "float32"}}}):
        spec, data = split_run_file({"launch": {"model": {"serve_dtype": "bfloat16"}, **section}}, "test")
        run = LocalRun(spec=spec, data=data, run_dir=tmp_path)
        run.model_dir = tmp_path / "model"
        with pytest.raises(ConfigError, match="serve_dtype"):
            run.service_configs("127.0.0.1:4242")


def test_a_service_deployed_with_the_run_file_serves_its_dtype(tmp_path):
    from flywheel.runtime.config import run_file_section

    run_file = tmp_path / "run.yaml"
    run_file.write_text("launch: {model: {serve_dtype: bfloat16}, rollout: {engine: {kind: vllm}}}\n")
    assert run_file_section(run_file, "trainer") == {"model": {"publish_dtype": "bfloat16"}}
    assert run_file_section(run_file, "rollout") == {"engine": {"kind": "vllm", "args": {"dtype": "bfloat16"}}}
    assert run_file_section(run_file, "synchronizer") == {}
    run_file.write_text("launch: {model: {serve_dtype: float16}}\n")
    with pytest.raises(ConfigError, match="serve_dtype"):
        run_file_section(run_file, "rollout")
