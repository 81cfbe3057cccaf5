"""A small reader for the Prometheus text exposition format, enough for ``afd-bench``.

A sample line is ``name{label="value",...} value [timestamp]``; ``#`` lines are comments. A series
may appear several times (prometheus multiprocess mode can keep one sample per process, with a
``pid`` label): every lookup here sums over all samples that carry the requested labels.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LINE = re.compile(rf"^({_NAME})\s*(?:\{{(.*)\}})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def _unescape(text: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], text)


def _labels(text: str) -> dict[str, str] | None:
    out, pos = {}, 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            return None if text[pos:].strip() else out
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


def parse(text: str) -> list[Sample]:
    """Every sample in ``text``; lines that are not samples (or are malformed) are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        labels = _labels(m.group(2) or "")
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if labels is not None:
            samples.append(Sample(m.group(1), value, labels))
    return samples


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
