"""Layered configuration: precedence, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.runtime.config import ConfigError, load_config, redacted, resolve
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig

PREFIX = "FLYWHEEL_TRAINER__"


def test_defaults_file_env_cli_precedence(tmp_path: Path) -> None:
    file = tmp_path / "trainer.yaml"
    file.write_text("server:\n  port: 1001\n  metrics_port: 2001\n  host: 0.0.0.0\nmodel:\n  dtype: bfloat16\n")
    env = {f"{PREFIX}SERVER__PORT": "1002", f"{PREFIX}SERVER__METRICS_PORT": "2002"}
    config = resolve(TrainerConfig, file=file, env=env, env_prefix=PREFIX, cli={"server.port": "1003"})
    assert config.server.port == 1003  # CLI beats env
    assert config.server.metrics_port == 2002  # env beats file
    assert config.server.host == "0.0.0.0"  # file beats default
    assert config.model.dtype == "bfloat16"
    assert config.model.device == "cpu"  # default
    assert config.server.log_level == "INFO"


def test_unknown_field_in_file_is_named(tmp_path: Path) -> None:
    file = tmp_path / "trainer.yaml"
    file.write_text("model:\n  pth: /x\n")
    with pytest.raises(ConfigError, match=r"model\.pth: unknown field .*file"):
        resolve(TrainerConfig, file=file, env={}, env_prefix=PREFIX)


def test_ill_typed_env_names_field_and_variable() -> None:
    with pytest.raises(ConfigError) as err:
        resolve(TrainerConfig, env={f"{PREFIX}SERVER__PORT": "not-a-port"}, env_prefix=PREFIX)
    assert "server.port" in str(err.value) and f"{PREFIX}SERVER__PORT" in str(err.value)


def test_unknown_env_variable_with_prefix_is_an_error() -> None:
    with pytest.raises(ConfigError, match=f"{PREFIX}SERVER__PROT"):
        resolve(TrainerConfig, env={f"{PREFIX}SERVER__PROT": "1"}, env_prefix=PREFIX)


def test_env_of_other_services_is_ignored() -> None:
    config = resolve(TrainerConfig, env={"FLYWHEEL_ROLLOUT__SERVER__PORT": "1", "PATH": "/bin"}, env_prefix=PREFIX)
    assert config.server.port == 50052


def test_out_of_range_value_names_field() -> None:
    with pytest.raises(ConfigError, match=r"server\.port: .*65535.*flag --server.port"):
        resolve(TrainerConfig, env={}, env_prefix=PREFIX, cli={"server.port": "70000"})


def test_choice_field_rejects_unknown_value() -> None:
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        resolve(TrainerConfig, env={}, env_prefix=PREFIX, cli={"model.dtype": "float8"})


def test_structured_values_parse_from_cli_and_env() -> None:
    prefix = "FLYWHEEL_ROLLOUT__"
    config = resolve(
        RolloutConfig,
        env={f"{prefix}ENGINE__ARGS": '{"max_model_len": 512, "enforce_eager": true}'},
        env_prefix=prefix,
        cli={"engine.kind": "transformers"},
    )
    assert config.engine.args == {"max_model_len": 512, "enforce_eager": True}
    assert config.engine.kind == "transformers"


def test_cli_flags_and_unknown_flag_exit(capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(
        TrainerConfig, ["--server.port", "7", "--model.device", "cuda:1"], prog="t", description="", env_prefix=PREFIX, env={}
    )
    assert (config.server.port, config.model.device) == (7, "cuda:1")
    with pytest.raises(SystemExit) as exit_info:
        load_config(TrainerConfig, ["--server.prot", "7"], prog="t", description="", env_prefix=PREFIX, env={})
    assert exit_info.value.code == 2
    assert "--server.prot" in capsys.readouterr().err


def test_bad_value_exits_with_message_naming_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_config(TrainerConfig, ["--server.port", "x"], prog="t", description="", env_prefix=PREFIX, env={})
    assert exit_info.value.code == 2
    assert "server.port" in capsys.readouterr().err


def test_secrets_are_masked_when_logged() -> None:
    config = resolve(TrainerConfig, env={f"{PREFIX}SERVER__AUTH_TOKEN": "hunter2"}, env_prefix=PREFIX)
    assert config.server.auth_token.get_secret_value() == "hunter2"
    assert "hunter2" not in str(redacted(config))


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml"):
        resolve(TrainerConfig, file=tmp_path / "nope.yaml", env={}, env_prefix=PREFIX)


def test_a_run_files_launch_section_is_the_services_base(tmp_path: Path) -> None:
    """Deployments point every service at the run file: launch.trainer is what the
    local launcher would give the trainer, below the env a manifest sets."""
    run = tmp_path / "run.yaml"
    run.write_text("run: {name: x}\nlaunch:\n  trainer:\n    optimizer: {lr: 1.0e-5}\n    model: {dtype: bfloat16}\n")
    env = {f"{PREFIX}MODEL__PATH": "/models/policy", f"{PREFIX}MODEL__DTYPE": "float32"}
    config = load_config(TrainerConfig, ["--run-file", str(run)], prog="t", description="", env_prefix=PREFIX,
                         env=env, section="trainer")
    assert config.optimizer.lr == 1.0e-5  # from the run file
    assert str(config.model.path) == "/models/policy" and config.model.dtype == "float32"  # env wins
    rollout = load_config(RolloutConfig, ["--run-file", str(run)], prog="r", description="",
                          env_prefix="FLYWHEEL_ROLLOUT__", env={}, section="rollout")
    assert rollout.engine.model_path is None  # no launch.rollout: the defaults


def test_a_bad_run_file_section_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("launch:\n  trainer: [1, 2]\n")
    with pytest.raises(SystemExit) as exc:
        load_config(TrainerConfig, ["--run-file", str(run)], prog="t", description="", env_prefix=PREFIX, env={},
                    section="trainer")
    assert exc.value.code == 2 and "launch.trainer: must be a mapping" in capsys.readouterr().err


def test_a_deployed_trainer_decays_its_learning_rate_over_the_runs_steps(tmp_path: Path) -> None:
    # A deployment's trainer reads the run file itself (--run-file): it must get the same total_steps
    # as the local launcher gives it (tests/unit/controller/test_launcher_spec.py).
    run = tmp_path / "run.yaml"
    run.write_text("run: {max_steps: 30}\nlaunch:\n  trainer: {optimizer: {lr: 1.0e-5, schedule: linear}}\n")
    config = load_config(TrainerConfig, ["--run-file", str(run)], prog="t", description="", env_prefix=PREFIX,
                         env={}, section="trainer")
    assert (config.optimizer.schedule, config.optimizer.total_steps) == ("linear", 30)


def test_a_description_with_a_percent_sign_shows_in_help() -> None:
    # argparse formats help strings with %, so an unescaped "22 %" in a description crashed --help.
    from pydantic import BaseModel, Field

    from flywheel.runtime.config import build_parser

    class WithPercent(BaseModel):
        ratio: float = Field(0.9, description="send a delta when it is under 90 % of the version (100%s fine)")

    help_text = build_parser(WithPercent, prog="t", description="", env_prefix=PREFIX).format_help()
    assert "under 90 % of the version (100%s fine)" in " ".join(help_text.split())
