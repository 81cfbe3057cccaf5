"""Sums and deltas over ``/metrics`` scrapes, what ``afd-bench`` reads between two of them.

The text is parsed by ``prometheus_client`` (installed with vLLM). What it does not provide is
added here: a series may appear several times (prometheus multiprocess mode can keep one sample
per process, with a ``pid`` label), so every lookup sums over all samples that carry the requested
labels, and counters and histograms are read as the growth between two scrapes.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; ValueError names a malformed line."""
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels``; None if there are none."""
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    found = [v for v in found if not math.isnan(v)]
    return sum(found) if found else None


def delta(before: list[Sample], after: list[Sample], name: str, **labels: str) -> float | None:
    """How much a counter (or a histogram's ``_sum``/``_count``) grew; None if the series is
    missing after. A series missing before counts from 0 (created in between)."""
    end = total(after, name, **labels)
    if end is None:
        return None
    return end - (total(before, name, **labels) or 0.0)


def mean_ms(before: list[Sample], after: list[Sample], histogram: str,
            **labels: str) -> float | None:
    """Mean observation of a histogram (seconds) between two scrapes, in milliseconds."""
    count = delta(before, after, histogram + "_count", **labels)
    seconds = delta(before, after, histogram + "_sum", **labels)
    if not count or seconds is None:
        return None
    return seconds / count * 1000.0
