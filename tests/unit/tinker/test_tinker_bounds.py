"""What a tenant may send is bounded and parsed strictly: tinker:// paths (no '..', no absolute or extra
components), request bodies as sent and once decompressed (a zstd frame's stated size refused before
anything is allocated), and tenant keys (re-read when the tokens file changes)."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from flywheel.errors import InvalidArgument, PermissionDenied, Unauthenticated
from flywheel.runtime.auth import Scope, TokenScopes
from flywheel.runtime.tokens import add_tenant_key, revoke_tenant
from services.tinker import tenants
from services.tinker.bodies import BodyTooLarge, decompressed, read_bounded
from services.tinker.paths import TinkerPath, parse_path
from services.tinker.tenants import LOCAL, TenantKeys

MODEL = "session-0123456789ab:train:0"


def test_a_path_is_a_model_of_ours_a_kind_and_one_safe_name() -> None:
    assert parse_path(f"tinker://{MODEL}/weights/step-3", "p") == TinkerPath(MODEL, "weights", "step-3")
    assert str(parse_path(f"tinker://{MODEL}/sampler_weights/a.b", "p")) == f"tinker://{MODEL}/sampler_weights/a.b"
    for bad, words in ((f"tinker://{MODEL}/weights/..", "no '..'"), (f"tinker://../weights/x", "no '..'"),
                       (f"tinker://{MODEL}/weights/../../etc", "is not tinker://"),
                       ("tinker:///etc/passwd", "is not tinker://"), (f"tinker://{MODEL}/weights/a..b", "no '..'"),
                       (f"tinker://{MODEL}/weights/x/y", "is not tinker://"), ("file:///etc", "not a tinker://"),
                       (f"tinker://{MODEL}/secrets/x", "kind must be"), ("tinker://other-run/weights/x", "not a model"),
                       (f"tinker://{MODEL}/weights/.hidden", "must be a name"), (None, "not a tinker://")):
        with pytest.raises(InvalidArgument, match=words):
            parse_path(bad, "p")
    with pytest.raises(InvalidArgument, match="kind must be weights"):
        parse_path(f"tinker://{MODEL}/sampler_weights/x", "p", ("weights",))


async def _chunks(*pieces: bytes):
    for piece in pieces:
        yield piece


async def test_a_body_past_the_bound_is_refused_on_its_length_or_as_it_arrives() -> None:
    assert await read_bounded("4", _chunks(b"ab", b"cd"), 4, "w") == b"abcd"
    with pytest.raises(BodyTooLarge, match="5000 bytes"):
        await read_bounded("5000", _chunks(), 4096, "w")
    with pytest.raises(BodyTooLarge, match="more than max_body_bytes=4"):
        await read_bounded(None, _chunks(b"abc", b"de"), 4, "w")


def test_a_zstd_frame_stating_more_than_the_bound_is_refused_before_any_allocation() -> None:
    limit = 1 << 20
    small = zstandard.ZstdCompressor().compress(b"x" * 1000)
    assert decompressed(small, limit, "fb") == b"x" * 1000
    # 64 MiB stated by the frame's first 32 bytes: a decompressor trusting the statement would allocate it.
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    header_only = bomb[:32]
    tracemalloc.start()
    with pytest.raises(BodyTooLarge, match="states 67108864 bytes"):
        decompressed(header_only, limit, "fb")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024  # nothing the size of the frame's claim was allocated
    # A frame that does not state its size is decompressed a piece at a time and stopped past the bound.
    obj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    unstated = obj.compress(b"\0" * (4 << 20)) + obj.flush()
    assert zstandard.frame_content_size(unstated) == -1
    with pytest.raises(BodyTooLarge, match="decompresses to more than"):
        decompressed(unstated, limit, "fb")
    with pytest.raises(InvalidArgument, match="not a zstd frame"):
        decompressed(b"not zstd", limit, "fb")


async def test_tenant_keys_name_their_tenant_and_are_re_read_when_the_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenants, "RELOAD_SECONDS", 0.0)
    path = tmp_path / "tokens.yaml"
    path.write_text("service: tml-service\n")
    alice = add_tenant_key(path, "alice")
    keys = TenantKeys(TokenScopes.of({Scope.SERVICE: ["tml-service"]}, {"alice": [alice]}), path)
    assert keys.tenant(alice, "POST x") == "alice"
    with pytest.raises(PermissionDenied, match="takes a tenant's key.*this is a service token"):
        keys.tenant("tml-service", "POST x")
    with pytest.raises(Unauthenticated):
        keys.tenant("tml-nobody", "POST x")
    bob = add_tenant_key(path, "bob")  # admitted without a restart ...
    await asyncio.sleep(0.01)
    assert keys.tenant(bob, "POST x") == "bob"
    revoke_tenant(path, "alice")  # ... and a revoked key refused from the next request on
    with pytest.raises(Unauthenticated):
        keys.tenant(alice, "POST x")
    assert TenantKeys(TokenScopes()).tenant("tml-anything", "POST x") == LOCAL  # no tokens: auth is off
