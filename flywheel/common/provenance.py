"""Per-token provenance: which weight version produced each sampled token.

A generation that runs across weight updates (pause mode `keep`) is made by
several policies. Its tokens' versions are carried compactly as *spans*: the
version changes a handful of times at most, so a completion of any length is
described by a few `VersionSpan(version, start, end)` over its token indexes
(end exclusive), the same shape as vLLM's `CompletionOutput.weight_versions`.

Spans of one completion are in order, contiguous and cover it exactly
(`check_spans`); a completion with no tokens has none. Every layer that
carries a completion carries its spans (the engine's `SampleOutput`, the
wire's `common.Sample.weight_version_spans`, the OpenAI extension
`weight_version.spans`, the controller's `Generation` and `Trajectory`), and
the controller expands them into the per-token versions of `TrainBatch`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple


class VersionSpan(NamedTuple):
    """Tokens [start, end) of a completion were sampled by weights of `version`."""

    version: int
    start: int
    end: int


def spans_of(versions: Iterable[int], offset: int = 0) -> list[VersionSpan]:
    """The spans of a per-token version list (token i at index offset + i)."""
    spans: list[VersionSpan] = []
    for i, version in enumerate(versions, start=offset):
        if spans and spans[-1].version == version and spans[-1].end == i:
            spans[-1] = spans[-1]._replace(end=i + 1)
        else:
            spans.append(VersionSpan(int(version), i, i + 1))
    return spans


def versions_of(spans: Sequence[VersionSpan], length: int) -> list[int]:
    """The version of each of `length` tokens (spans as `check_spans` accepts them)."""
    check_spans(spans, length)
    out: list[int] = []
    for span in spans:
        out.extend([span.version] * (span.end - span.start))
    return out


def check_spans(spans: Sequence[VersionSpan], length: int, what: str = "weight_version_spans") -> None:
    """ValueError unless `spans` cover tokens [0, length) in order, without gap or overlap, each non-empty."""
    at = 0
    for i, span in enumerate(spans):
        if span.start != at or span.end <= span.start or span.version < 0:
            raise ValueError(f"{what}[{i}]: ({span.version}, {span.start}, {span.end}) does not continue the "
                             f"spans before it at token {at} (spans are in order, contiguous, non-empty)")
        at = span.end
    if at != length:
        raise ValueError(f"{what}: the spans cover {at} tokens, the completion has {length}")


def shifted(spans: Iterable[VersionSpan], offset: int) -> list[VersionSpan]:
    """`spans` moved `offset` tokens on (a turn's spans placed in a multi-turn response)."""
    return [VersionSpan(s.version, s.start + offset, s.end + offset) for s in spans]


def merged(spans: Iterable[VersionSpan]) -> list[VersionSpan]:
    """Adjacent spans of the same version joined (the spans of concatenated completions)."""
    out: list[VersionSpan] = []
    for s in spans:
        if out and out[-1].version == s.version and out[-1].end == s.start:
            out[-1] = out[-1]._replace(end=s.end)
        else:
            out.append(s)
    return out
