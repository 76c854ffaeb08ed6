"""`python -m flywheel.runtime.tokens`: the tokens file the shipped deployments generate
(one fresh token per scope, mode 0600, never overwritten) and one token read back out."""

from __future__ import annotations

import io
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.runtime.auth import TOKEN_SCOPES, Scope, TokenScopes, accepted_tokens, read_tenant_keys, read_tokens_file
from flywheel.runtime.server_config import ServerConfig
from flywheel.runtime.tokens import main


def test_init_writes_one_secret_token_per_scope_and_keeps_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    assert main(["init", str(path)]) == 0
    tokens = read_tokens_file(path)
    assert set(tokens) == set(TOKEN_SCOPES) and all(len(listed) == 1 for listed in tokens.values())
    assert len({listed[0] for listed in tokens.values()}) == len(TOKEN_SCOPES)  # no two scopes share a token
    # 256 random bits, behind the prefix the Tinker SDK requires of an API key.
    assert all(listed[0].startswith("tml-") and len(listed[0]) == 4 + 64 for listed in tokens.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert main(["init", str(path)]) == 0
    assert read_tokens_file(path) == tokens  # clients keep the tokens they hold


def test_init_refuses_an_existing_file_the_services_could_not_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("admin: x\n")
    assert main(["init", str(path)]) == 2
    assert "unknown scope 'admin'" in capsys.readouterr().err


def test_show_prints_one_scope_token_from_the_file_or_the_env(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("viewer: v1\nagent: [a1, a2]\n")
    assert main(["show", "agent", str(path)]) == 0
    assert capsys.readouterr().out == "a1\n"
    monkeypatch.setenv("FLYWHEEL_TOKENS_FILE", str(path))
    assert main(["show", "viewer"]) == 0
    assert capsys.readouterr().out == "v1\n"
    assert main(["show", "operator"]) == 2
    assert "no operator token" in capsys.readouterr().err


def test_it_runs_as_a_module(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    done = subprocess.run([sys.executable, "-m", "flywheel.runtime.tokens", "init", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "wrote tokens file" in done.stderr and path.exists(), done.stderr


def test_init_from_copies_another_deployments_tokens_after_checking_them(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    central = tmp_path / "central.yaml"
    assert main(["init", str(central)]) == 0
    far = tmp_path / "far.yaml"
    monkeypatch.setattr(sys, "stdin", io.StringIO(central.read_text()))
    assert main(["init", "--from", "-", str(far)]) == 0
    assert read_tokens_file(far) == read_tokens_file(central) and stat.S_IMODE(far.stat().st_mode) == 0o600
    (tmp_path / "bad.yaml").write_text("- a\n")
    assert main(["init", "--from", str(tmp_path / "bad.yaml"), str(tmp_path / "other.yaml")]) == 2
    assert not (tmp_path / "other.yaml").exists()


def test_tenant_keys_are_made_listed_by_their_first_characters_and_revoked(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "tokens.yaml"
    assert main(["init", str(path)]) == 0
    staff = read_tokens_file(path)
    assert main(["tenant", "add", "alice", str(path)]) == 0
    alice = capsys.readouterr().out.strip()
    assert main(["tenant", "add", "alice", str(path)]) == 0 and main(["tenant", "add", "bob", str(path)]) == 0
    alice_2, bob = capsys.readouterr().out.split()
    assert alice.startswith("tml-") and len({alice, alice_2, bob}) == 3
    assert read_tenant_keys(path) == {"alice": [alice, alice_2], "bob": [bob]}
    assert read_tokens_file(path) == staff and stat.S_IMODE(path.stat().st_mode) == 0o600  # the rest stays
    assert main(["tenant", "list", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "alice\t2 keys" in listed and alice[:12] in listed and alice not in listed  # never a whole key
    # A tenant key is known everywhere as scope `tenant`, below every method's scope; it names its tenant.
    tokens = accepted_tokens(ServerConfig(tokens_file=path), env={})
    assert tokens.scope_of(f"Bearer {bob}") is Scope.TENANT and tokens.tenant_of(f"Bearer {bob}") == "bob"
    assert tokens.tenant_of(f"Bearer {staff[Scope.SERVICE][0]}") is None
    assert main(["tenant", "revoke", "--key", alice[:12], "alice", str(path)]) == 0
    assert read_tenant_keys(path) == {"alice": [alice_2], "bob": [bob]}
    assert main(["tenant", "revoke", "bob", str(path)]) == 0
    assert read_tenant_keys(path) == {"alice": [alice_2]}
    assert main(["tenant", "revoke", "bob", str(path)]) == 2 and "no tenant 'bob'" in capsys.readouterr().err
    assert main(["tenant", "add", "Bad/Name", str(path)]) == 2
    assert isinstance(TokenScopes.of({}, {"a": ["k"]}), TokenScopes)


def test_a_tenant_entry_must_be_a_mapping_of_safe_names(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    for text, words in (("tenants: [a]\n", "mapping of tenant"), ("tenants: {'../x': k}\n", "must be lowercase"),
                        ("tenant: k\n", "tenant keys go under")):
        path.write_text(text)
        with pytest.raises(Exception, match=words):
            read_tokens_file(path)
