"""launch.tls: one throwaway CA per launch, handed to every service started here and to this process."""

from __future__ import annotations

import pytest

from flywheel.runtime import tls as tls_module
from services.controller.launcher.spec import split_run_file


@pytest.mark.parametrize("mode", [True, "mutual"])
def test_every_local_service_gets_the_launchs_certificate(tmp_path, monkeypatch, mode) -> None:
    from services.controller.launcher.local_run import LocalRun
    from services.rollout.config import RolloutConfig
    from services.trainer.config import TrainerConfig

    monkeypatch.setattr(tls_module, "_adopted", None)  # restored afterwards: other tests call in plaintext
    spec, data = split_run_file({"launch": {"model": {"source": "tiny"}, "tls": mode}}, "test")
    run = LocalRun(spec=spec, data=data, run_dir=tmp_path)
    run.model_dir = tmp_path / "model"
    first = run.service_configs("127.0.0.1:4242")
    again = run.service_configs("127.0.0.1:4242")  # a rewind: the same CA, not a new one
    assert first == again
    for name, cls in (("trainer", TrainerConfig), ("rollout", RolloutConfig)):
        files = tls_module.resolve(cls.model_validate(first[name]).server.tls, env={})
        assert files.serving and files.calling and files.ca_file == tmp_path / "tls" / "ca.pem"
        assert (files.client_ca_file is not None) == (mode == "mutual")
    assert tls_module.process_tls().calling  # the launcher's own calls verify the services too
    assert oct((tmp_path / "tls" / "service.key").stat().st_mode & 0o777) == "0o600"


def test_without_launch_tls_nothing_changes(tmp_path, monkeypatch) -> None:
    from services.controller.launcher.local_run import LocalRun

    monkeypatch.setattr(tls_module, "_adopted", None)
    spec, data = split_run_file({"launch": {"model": {"source": "tiny"}}}, "test")
    run = LocalRun(spec=spec, data=data, run_dir=tmp_path)
    run.model_dir = tmp_path / "model"
    assert "server" not in run.service_configs("127.0.0.1:4242")["trainer"]
    assert not (tmp_path / "tls").exists() and tls_module._adopted is None
