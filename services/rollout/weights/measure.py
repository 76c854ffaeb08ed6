"""An update's verify phase: what the engine measured of the weights it now
holds, against what the version is (its recorded identity, with each
tensor's digest, and the trainer's probe).

- Every digest the engine measured (RESIDENT: read back as it sits;
  RECEIVED: hashed by its loader as it consumed it) must equal the
  version's; one that differs fails the update, naming the tensors.
- The probe (`flywheel.probe`), when the version has one, compares the
  engine's log-probs of the probe tokens on its resident weights with the
  trainer's; beyond the engine's tolerance it fails the update.
- Coverage: the version is VERIFIED only when every tensor is covered by
  RESIDENT, or by RECEIVED with a passing probe (`UpdateCoverage.complete`).
  Less is UNVERIFIED: nothing contradicts the version, nothing proves it.

The replica reports as its resident identity only a digest it computed: the
version digest of the tensor digests it measured, when it measured every
tensor; nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flywheel.codec.identity import VersionIdentity, version_digest
from flywheel.probe import ProbeBatch, ProbeCheck, ProbeTolerance, check
from flywheel.synchronizer.types import UpdateCoverage
from services.rollout.engine.base import Engine, Measured, TensorSpec


@dataclass(frozen=True)
class Verdict:
    coverage: UpdateCoverage
    #: Tensors whose measured digest is not the version's, sorted.
    wrong: list[str]
    #: The version digest of the measured tensor digests, when every tensor was measured (b"" otherwise).
    resident_identity: bytes
    #: What the engine measured (to judge again with a probe).
    measured: Measured

    @property
    def failed(self) -> bool:
        return bool(self.wrong) or (self.coverage.probe.ran and not self.coverage.probe.passed)

    def describe_failure(self, version: int) -> str:
        parts = []
        if self.wrong:
            shown = ", ".join(self.wrong[:3]) + (f" and {len(self.wrong) - 3} more" if len(self.wrong) > 3 else "")
            parts.append(f"{len(self.wrong)} tensor(s) differ: {shown}")
        probe = self.coverage.probe
        if probe.ran and not probe.passed:
            parts.append(f"the {probe.describe()} (worst at sequence {probe.worst[0]}, token {probe.worst[1]})")
        return f"the resident weights are not version {version}: " + "; ".join(parts)


def judge(specs: Mapping[str, TensorSpec], expected: VersionIdentity | None, measured: Measured,
          probe: ProbeCheck) -> Verdict:
    """The update's verdict from what was measured (see the module docstring)."""
    wanted = dict(expected.tensors) if expected is not None and expected.tensors else {}
    if wanted and version_digest(wanted) != expected.digest:  # type: ignore[union-attr]
        wanted = {}  # digests that do not make the version's identity prove nothing
    resident_n = resident_b = received_n = received_b = 0
    wrong: list[str] = []
    digests: dict[str, bytes] = {}
    total_bytes = 0
    for name, spec in specs.items():
        nbytes = spec.dtype.itemsize * _numel(spec.shape)
        total_bytes += nbytes
        want = wanted.get(name)
        at_rest, taken = measured.resident.get(name), measured.received.get(name)
        digest = at_rest if at_rest is not None else taken
        if digest is not None:
            digests[name] = digest
        if want is None:
            continue
        if (at_rest is not None and at_rest != want) or (taken is not None and taken != want):
            wrong.append(name)
        elif at_rest is not None:
            resident_n, resident_b = resident_n + 1, resident_b + nbytes
        elif taken is not None:
            received_n, received_b = received_n + 1, received_b + nbytes
    coverage = UpdateCoverage(tensors=len(specs), bytes=total_bytes, resident_tensors=resident_n,
                              resident_bytes=resident_b, received_tensors=received_n, received_bytes=received_b,
                              probe=probe)
    identity = version_digest(digests) if len(digests) == len(specs) and specs else b""
    return Verdict(coverage, sorted(wrong), identity, measured)


async def run_probe(engine: Engine, probe: ProbeBatch | None, tolerance: ProbeTolerance) -> ProbeCheck:
    """Scores the probe batch on the engine's resident weights and compares with the trainer's. Not run
    (ran=False) without a probe, or on an engine that cannot score."""
    if probe is None or not engine.supports_prompt_logprobs:
        return ProbeCheck()
    return check(probe, await engine.score(probe.token_ids), tolerance)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
