"""The probe: a behavioural check that a replica's resident weights are the
version the trainer made, for the tensors an engine cannot read back as the
checkpoint holds them (vLLM on CPU repacks every linear layer).

With each version it publishes, the trainer computes the log-probs of a
small fixed batch of token sequences (`probe_sequences`: seeded, the same for
every version of a model) in float32, and the synchronizer records them with
the version's identity. After loading the version, before generation's gate
reopens, a replica scores the same sequences on its resident weights and
compares: the largest per-token difference must stay within the engine's
tolerance (measured per engine and dtype; docs/verification.md).

Random token sequences are out of any task's distribution, which does not
matter here: every weight of every layer reaches the log-probs of every
position, so a layer loaded wrong moves them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from flywheel.common.v1 import common_pb2

#: Sequences of the probe batch, and tokens each: 16 tokens, 15 compared. A replica scores them inside
#: its update's pause (a forward of 16 tokens: most of the pause of a 0.5B model on one CPU core), and
#: that is enough to see every fault class the tests inject: a linear layer scaled by 1.01 moves the
#: tiny test model's log-probs by about 1e-3 nats and SmolLM2's by 0.1, against 1e-6 and 6e-5 between a
#: correct replica and the trainer (float32, vLLM on CPU; docs/verification.md).
PROBE_SEQUENCES = 1
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


@dataclass(frozen=True)
class ProbeCheck:
    """A replica's probe of its resident weights against the trainer's."""

    #: False: no probe ran (the version carries none, or the engine cannot score).
    ran: bool = False
    tokens: int = 0
    #: Largest and mean |replica - trainer| per-token log-prob difference, in nats.
    max_abs_diff: float = 0.0
    mean_abs_diff: float = 0.0
    #: The largest difference accepted, in nats.
    tolerance: float = 0.0
    passed: bool = False
    #: Where the largest difference is (sequence, position), for the record.
    worst: tuple[int, int] = field(default=(0, 0), compare=False)

    def describe(self) -> str:
        if not self.ran:
            return "no probe"
        return (f"probe of {self.tokens} tokens: max |diff| {self.max_abs_diff:.3g} nats (mean {self.mean_abs_diff:.3g}), "
                f"tolerance {self.tolerance:.3g}: {'passed' if self.passed else 'FAILED'}")


def check(expected: ProbeBatch, measured: Sequence[Sequence[float]], tolerance: float) -> ProbeCheck:
    """Compares a replica's log-probs of the probe sequences with the trainer's."""
    if len(measured) != len(expected.logprobs):
        raise ValueError(f"the replica scored {len(measured)} probe sequences, the probe has {len(expected.logprobs)}")
    worst, worst_at, total, count = -1.0, (0, 0), 0.0, 0
    for s, (want, got) in enumerate(zip(expected.logprobs, measured)):
        if len(got) != len(want):
            raise ValueError(f"probe sequence {s}: the replica scored {len(got)} tokens, the probe has {len(want)}")
        for i, (a, b) in enumerate(zip(want, got)):
            diff = abs(float(a) - float(b))
            if diff != diff:  # NaN: a broken model, never within tolerance
                diff = float("inf")
            total += diff
            count += 1
            if diff > worst:
                worst, worst_at = diff, (s, i)
    worst = max(worst, 0.0)
    return ProbeCheck(ran=True, tokens=count, max_abs_diff=worst, mean_abs_diff=total / max(count, 1),
                      tolerance=tolerance, passed=worst <= tolerance, worst=worst_at)
