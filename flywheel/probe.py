"""The probe: a behavioural check that a replica's resident weights are the
version the trainer made, for the tensors an engine cannot read back as the
checkpoint holds them (vLLM on CPU repacks every linear layer).

With each version it publishes, the trainer computes the log-probs of a
small fixed batch of token sequences (`probe_sequences`: seeded, the same for
every version of a model) in float32, and the synchronizer records them with
the version's identity. After loading the version, before generation's gate
reopens, a replica scores the same sequences on its resident weights and
compares: a statistic of the per-token differences must stay within the
engine's tolerance (`ProbeTolerance`, measured per engine and dtype;
docs/verification.md): the largest difference where the engine's kernels are
the trainer's, the median where they are not (vLLM, in float32 as in
bfloat16), since there the largest of correct weights' differences is
heavy-tailed and a run would stop on a correct version.

Random token sequences are out of any task's distribution, which does not
matter here: every weight of every layer reaches the log-probs of every
position, so a layer loaded wrong moves them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from statistics import median

from flywheel.common.v1 import common_pb2

#: Sequences of the probe batch, and tokens each: 4 x 16 tokens, 60 compared. A replica scores them inside
#: its update's pause (one forward of 64 tokens), and that is enough to see every fault class the tests
#: inject: a linear layer scaled by 1.01 moves the tiny test model's log-probs by about 1e-3 nats and
#: SmolLM2's by 0.1, against 1e-6 and 6e-5 between a correct replica and the trainer (float32, vLLM on
#: CPU). In bfloat16 the 60 tokens are what holds the median (the fewer the tokens, the wider its spread):
#: over 60, at most 0.092 nats on SmolLM2's correct weights against 1.10 and more with two layers swapped
#: (50 probes each; docs/verification.md, bench/results/experiments/probe_noise.jsonl).
PROBE_SEQUENCES = 4
PROBE_LENGTH = 16
#: The seed the token ids are drawn with (fixed: every version of a model gets the same batch).
PROBE_SEED = 0x5EED


def probe_sequences(vocab_size: int, count: int = PROBE_SEQUENCES, length: int = PROBE_LENGTH) -> list[list[int]]:
    """The probe batch's token ids for a model of `vocab_size` tokens (deterministic)."""
    if vocab_size < 2:
        raise ValueError(f"a probe needs a vocabulary of at least 2 tokens, got {vocab_size}")
    rng = random.Random(PROBE_SEED)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


@dataclass(frozen=True)
class ProbeBatch:
    """Token sequences and their log-probs under one version (log p(ids[i + 1] | ids[:i + 1]))."""

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"a probe has {len(self.token_ids)} sequences and {len(self.logprobs)} log-prob rows")
        for ids, lps in zip(self.token_ids, self.logprobs):
            if len(ids) < 2 or len(lps) != len(ids) - 1:
                raise ValueError(f"a probe sequence of {len(ids)} tokens needs {max(len(ids) - 1, 1)} log-probs, "
                                 f"got {len(lps)}")

    @property
    def tokens(self) -> int:
        """Tokens compared (log-probs in all)."""
        return sum(len(lps) for lps in self.logprobs)

    @classmethod
    def of(cls, token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]) -> ProbeBatch:
        return cls(tuple(tuple(int(t) for t in ids) for ids in token_ids),
                   tuple(tuple(float(x) for x in lps) for lps in logprobs))

    def to_pb(self) -> common_pb2.ProbeBatch:
        return common_pb2.ProbeBatch(sequences=[common_pb2.ProbeSequence(token_ids=ids, logprobs=lps)
                                                for ids, lps in zip(self.token_ids, self.logprobs)])

    @classmethod
    def from_pb(cls, msg: common_pb2.ProbeBatch) -> ProbeBatch | None:
        """None for an empty message (no probe)."""
        if not msg.sequences:
            return None
        return cls.of([s.token_ids for s in msg.sequences], [s.logprobs for s in msg.sequences])


class ProbeStatistic(Enum):
    """The difference a check holds to its tolerance (values: the protobuf enum's)."""

    #: The largest per-token difference: where the engine's kernels are the trainer's (transformers).
    MAX = 1
    #: The median: where they are not (vLLM), robust to the heavy tail of single tokens that stray.
    MEDIAN = 2


@dataclass(frozen=True)
class ProbeTolerance:
    """An engine's bound on the probe's differences, in nats, and the statistic it bounds."""

    nats: float
    statistic: ProbeStatistic = ProbeStatistic.MAX

    def __post_init__(self) -> None:
        if not self.nats > 0:
            raise ValueError(f"a probe tolerance must be > 0 nats, got {self.nats}")


@dataclass(frozen=True)
class ProbeCheck:
    """A replica's probe of its resident weights against the trainer's."""

    #: False: no probe ran (the version carries none, or the engine cannot score).
    ran: bool = False
    tokens: int = 0
    #: Largest and mean |replica - trainer| per-token log-prob difference, in nats.
    max_abs_diff: float = 0.0
    mean_abs_diff: float = 0.0
    #: The bound on `statistic`, in nats.
    tolerance: float = 0.0
    passed: bool = False
    #: Where the largest difference is (sequence, position), for the record.
    worst: tuple[int, int] = field(default=(0, 0), compare=False)
    #: The median per-token difference, in nats.
    median_abs_diff: float = 0.0
    #: Which difference `tolerance` bounds.
    statistic: ProbeStatistic = ProbeStatistic.MAX

    @property
    def held(self) -> float:
        """The difference the check holds to its tolerance."""
        return self.median_abs_diff if self.statistic is ProbeStatistic.MEDIAN else self.max_abs_diff

    def describe(self) -> str:
        if not self.ran:
            return "no probe"
        return (f"probe of {self.tokens} tokens: {self.statistic.name.lower()} |diff| {self.held:.3g} nats "
                f"(max {self.max_abs_diff:.3g}, median {self.median_abs_diff:.3g}, mean {self.mean_abs_diff:.3g}), "
                f"tolerance {self.tolerance:.3g}: {'passed' if self.passed else 'FAILED'}")


def check(expected: ProbeBatch, measured: Sequence[Sequence[float]], tolerance: ProbeTolerance) -> ProbeCheck:
    """Compares a replica's log-probs of the probe sequences with the trainer's."""
    if len(measured) != len(expected.logprobs):
        raise ValueError(f"the replica scored {len(measured)} probe sequences, the probe has {len(expected.logprobs)}")
    diffs: list[float] = []
    worst, worst_at = -1.0, (0, 0)
    for s, (want, got) in enumerate(zip(expected.logprobs, measured)):
        if len(got) != len(want):
            raise ValueError(f"probe sequence {s}: the replica scored {len(got)} tokens, the probe has {len(want)}")
        for i, (a, b) in enumerate(zip(want, got)):
            diff = abs(float(a) - float(b))
            if diff != diff:  # NaN: a broken model, never within tolerance (whatever the statistic: below)
                diff = float("inf")
            if diff > worst:
                worst, worst_at = diff, (s, i)
            diffs.append(diff)
    if not diffs:
        raise ValueError("the probe compared no tokens")
    result = ProbeCheck(ran=True, tokens=len(diffs), max_abs_diff=worst, mean_abs_diff=sum(diffs) / len(diffs),
                        tolerance=tolerance.nats, worst=worst_at, median_abs_diff=median(diffs),
                        statistic=tolerance.statistic)
    return replace(result, passed=result.held <= tolerance.nats and math.isfinite(worst))
