"""The age of consumed samples by completion length: does the staleness policy bias training by length?

A sample's *age* when it is trained is `trained version - version_start` (its
staleness: the oldest policy that made any of its tokens). Long answers
finish late, so whatever a run does with late groups shows as a difference
between the ages of long and short samples: with `staleness.policy: drop`
the long ones that finished too late were thrown away (and the survivors are
young), with `pace` they are trained, older but within the bound.

Samples are bucketed by completion length, the tokens the policy generated
(`sum(response_mask)`: tool and environment tokens excluded), in fixed
geometric buckets, so the keys are the same in every step and every run:

    len_le_64, len_le_256, len_le_1024, len_le_4096, len_gt_4096

For each bucket that has seen a sample, each step writes, over every sample
trained so far in this session (cumulative, so the tail of a bucket with few
samples per step is still measured):

    staleness/age_p50/<bucket>, staleness/age_p95/<bucket>   nearest-rank percentiles (versions)
    staleness/age_mean/<bucket>                              mean
    staleness/age_samples/<bucket>                           samples trained

The bucket counts are where a length bias shows first: with threshold 1
nearly every sample is trained at age 1 whatever its length, but `drop`
trains far fewer long samples than were generated. The samples it dropped
as stale are counted by the same buckets (`staleness/dropped_samples/<bucket>`,
written by the pipeline from the processor's `stale_by_length`).

Ages are small integers, kept as counts per age, so the memory is bounded
by buckets x distinct ages whatever the run's length.

A sample made across weight updates has tokens of several ages; the tokens
the loss reads are measured one by one (`token_age_metrics`, per step):

    staleness/token_age_mean, staleness/token_age_max     over the step's trained tokens
    staleness/token_age/<age>                             trained tokens of that age
    staleness/masked_tokens[_total]                       tokens past the bound, masked out of the loss
    staleness/corrected_tokens[_total]                    ... or trained with the IS correction
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from services.controller.batches.batching import TrainBatch
from services.controller.domain import Trajectory

#: Upper bounds (inclusive, tokens) of the length buckets; longer is the last bucket.
BUCKETS: tuple[int, ...] = (64, 256, 1024, 4096)


def bucket_of(length: int, bounds: Sequence[int] = BUCKETS) -> str:
    for bound in bounds:
        if length <= bound:
            return f"len_le_{bound}"
    return f"len_gt_{bounds[-1]}"


def completion_length(t: Trajectory) -> int:
    """Tokens the policy generated (tool and environment tokens excluded)."""
    return int(sum(t.response_mask))


def percentile(counts: Counter[int], q: float) -> int:
    """Nearest-rank percentile (0 < q <= 100) of a histogram {value: count}."""
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * total))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    raise AssertionError("unreachable")


class SampleAgeReport:
    def __init__(self, bounds: Sequence[int] = BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.ages: dict[str, Counter[int]] = {}

    def observe(self, trained_version: int, trajectories: Iterable[Trajectory]) -> None:
        for t in trajectories:
            bucket = bucket_of(completion_length(t), self.bounds)
            self.ages.setdefault(bucket, Counter())[trained_version - t.version] += 1

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for bucket in self._order():
            counts = self.ages[bucket]
            out[f"staleness/age_p50/{bucket}"] = float(percentile(counts, 50))
            out[f"staleness/age_p95/{bucket}"] = float(percentile(counts, 95))
            out[f"staleness/age_mean/{bucket}"] = sum(age * n for age, n in counts.items()) / sum(counts.values())
            out[f"staleness/age_samples/{bucket}"] = float(sum(counts.values()))
        return out

    def _order(self) -> list[str]:
        names = [bucket_of(b, self.bounds) for b in self.bounds] + [f"len_gt_{self.bounds[-1]}"]
        return [n for n in names if n in self.ages]


def token_age_metrics(batch: TrainBatch, stale_tokens_total: int) -> dict[str, float]:
    """The ages of the tokens a batch trains, and the tokens past the bound (this step's, and in every batch
    trained so far this session: `stale_tokens_total`), masked or corrected. Written every step, so a run
    that masks none says so."""
    ages = batch.token_ages
    trained = sum(ages.values())
    out = {
        "staleness/token_age_mean": sum(age * n for age, n in ages.items()) / trained if trained else 0.0,
        "staleness/token_age_max": float(max(ages, default=0)),
    }
    out.update({f"staleness/token_age/{age}": float(n) for age, n in sorted(ages.items())})
    # One of the two happens to the tokens past the bound, by the run's policy; the other counts none.
    done, other = ("corrected", "masked") if batch.stale_corrected else ("masked", "corrected")
    out[f"staleness/{done}_tokens"] = float(batch.stale_tokens)
    out[f"staleness/{done}_tokens_total"] = float(stale_tokens_total)
    out[f"staleness/{other}_tokens"] = out[f"staleness/{other}_tokens_total"] = 0.0
    return out
