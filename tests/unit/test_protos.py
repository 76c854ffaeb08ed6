"""The contracts: stubs up to date, and the style rules every proto follows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor

from flywheel.common.v1 import common_pb2
from flywheel.controller.v1 import controller_pb2
from flywheel.rollout.v1 import rollout_pb2
from flywheel.synchronizer.v1 import synchronizer_pb2
from flywheel.trainer.v1 import trainer_pb2

ROOT = Path(__file__).resolve().parents[2]
MODULES = [common_pb2, trainer_pb2, rollout_pb2, synchronizer_pb2, controller_pb2]
SERVICE_MODULES = [trainer_pb2, rollout_pb2, synchronizer_pb2, controller_pb2]


def test_generated_stubs_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"run `make protos`:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.DESCRIPTOR.package)
def test_packages_are_versioned(module) -> None:
    assert re.fullmatch(r"flywheel\.[a-z]+\.v1", module.DESCRIPTOR.package)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.DESCRIPTOR.package)
def test_enums_start_with_unspecified_and_prefix_values(module) -> None:
    enums = list(module.DESCRIPTOR.enum_types_by_name.values())
    for message in module.DESCRIPTOR.message_types_by_name.values():
        enums.extend(message.enum_types)
    for enum in enums:
        prefix = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", enum.name).upper() + "_"
        assert enum.values[0].number == 0 and enum.values[0].name == prefix + "UNSPECIFIED", enum.full_name
        for value in enum.values:
            assert value.name.startswith(prefix), f"{enum.full_name}.{value.name} lacks prefix {prefix}"


@pytest.mark.parametrize("module", SERVICE_MODULES, ids=lambda m: m.DESCRIPTOR.package)
def test_one_service_per_file_with_request_response_pairs(module) -> None:
    services = list(module.DESCRIPTOR.services_by_name.values())
    assert len(services) == 1
    for method in services[0].methods:
        assert method.input_type.name == f"{method.name}Request", method.full_name
        assert method.output_type.name == f"{method.name}Response", method.full_name
        assert method.input_type.file is module.DESCRIPTOR, "requests belong to the service's own package"


def test_weight_chunk_carries_what_a_receiver_needs() -> None:
    fields = set(common_pb2.WeightChunk.DESCRIPTOR.fields_by_name)
    assert {"version", "base_version", "tensor_name", "dtype", "shape", "offset", "data", "checksum", "last"} <= fields
    assert {"tensors", "total_bytes", "digest"} <= set(common_pb2.WeightManifest.DESCRIPTOR.fields_by_name)
    dtypes = set(common_pb2.DType.keys())
    assert {"DTYPE_BFLOAT16", "DTYPE_FLOAT16", "DTYPE_FLOAT32", "DTYPE_FLOAT8_E4M3FN", "DTYPE_FLOAT8_E5M2"} <= dtypes
    states = set(common_pb2.ComponentState.keys())
    assert {f"COMPONENT_STATE_{s}" for s in ("STOPPED", "RUNNING", "REQUIRE_SYNC", "WAITING_SYNC")} <= states


def _field_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every field declaration in a proto file."""
    field = re.compile(r"^\s*(optional\s+|repeated\s+)?[\w.<>, ]+\s+\w+\s*=\s*\d+;")
    return [(i, line) for i, line in enumerate(text.splitlines()) if field.match(line) and "reserved" not in line]


@pytest.mark.parametrize("proto", sorted((ROOT / "protos").rglob("*.proto")), ids=lambda p: p.name)
def test_every_field_has_a_comment(proto: Path) -> None:
    lines = proto.read_text().splitlines()
    missing = []
    for number, line in _field_lines(proto.read_text()):
        previous = lines[number - 1].strip()
        is_enum_value = re.match(r"^\s*[A-Z0-9_]+\s*=\s*\d+;", line)
        if not is_enum_value and not previous.startswith("//"):
            missing.append(line.strip())
    assert not missing, f"fields without a comment in {proto.name}: {missing}"


def test_field_parser_sees_fields() -> None:
    # Guards the comment test above against a regex that matches nothing.
    text = (ROOT / "protos/flywheel/common/v1/common.proto").read_text()
    assert len(_field_lines(text)) > 40
    assert isinstance(common_pb2.WeightChunk.DESCRIPTOR, descriptor.Descriptor)
