"""The numbers ``afd-bench`` reports, computed from request timings and metric scrapes.

Definitions (the same for every configuration):

* ``tokens_per_s``: output tokens of the measured batches / their wall time (first request sent
  to last response complete, summed over the repeats).
* ``tpot_*_ms``: time per output token of one request, ``(t_last - t_first) / (n - 1)`` over its
  token arrival times; p50/p99 are taken **over requests**. ``itl_*_ms`` are the same
  percentiles over every inter-token gap of every request (a chunk carrying k tokens counts as k
  gaps of 1/k of its delay), which shows stalls that a per-request mean hides.
* ``decode_tokens_per_s``, ``decode_tpot_*_ms``, ``decode_itl_*_ms``: the same three, counted
  only inside each batch's ``decode_window``, so no prefill is in them.
* ``t_a_ms`` / ``t_e_ms`` / ``t_c_ms``: mean attention compute, FFN compute, and attention-side
  wait per (MoE layer, micro-batch), from the roles' histograms over the measured batches.
* ``eta = m * L * max(t_a, t_e) / t_step``: how much of an attention step the busier side's work
  fills, with ``m`` micro-batches and ``L`` MoE layers (1.0 = the slower side never waits).
* ``sizing``: the ``m`` that would hide the transfers and the A:F ratio that would balance the
  roles (``sizing_hint``).

The AFD breakdown is of decode steps only: each role's ``/metrics`` is scraped once every
request of a batch has its first token and again when the batch is over.

In a sweep (``--preset sweep``), each context's entries are decode-only: ``tpot_*`` and
``itl_*`` are the ``decode_*`` ones, ``ratio_vs_colocated`` divides decode tokens per second, and
AFD entries add ``ideal_step_ms`` (``ideal_step_ms``) and ``ideal_ratio_vs_colocated``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from afd_common.tools.bench import prom


@dataclass
class RequestTiming:
    """One streamed request: when it was sent, when each chunk of tokens arrived, when it ended."""
    t_send: float
    t_end: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in chunk)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0][0] - self.t_send if self.arrivals else None

    @property
    def tpot_s(self) -> float | None:
        n = self.tokens
        if n < 2:
            return None
        return (self.arrivals[-1][0] - self.arrivals[0][0]) / (n - 1)

    def gaps_s(self) -> list[float]:
        out = []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:]):
            out += [(t1 - t0) / n] * n
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def decode_window(batch: list[RequestTiming]) -> tuple[float, float] | None:
    """The part of a batch sent at once where every request was decoding: from the last first
    token (every prefill done) to the first last token (none finished yet). None when the two
    overlap (a prefill still ran when a request was done)."""
    streamed = [r for r in batch if r.arrivals]
    if not streamed:
        return None
    start = max(r.arrivals[0][0] for r in streamed)
    end = min(r.arrivals[-1][0] for r in streamed)
    return (start, end) if end > start else None


def decode_summary(batches: list[tuple[float, list[RequestTiming]]]) -> dict:
    """Decode measured as decode: tokens, TPOT and inter-token gaps inside each batch's
    ``decode_window`` only, so no prefill (one's own or another request's) is in them."""
    seconds, tokens, tpots, gaps = 0.0, 0, [], []
    for _, batch in batches:
        window = decode_window(batch)
        if window is None:
            continue
        start, end = window
        seconds += end - start
        for r in batch:
            inside = [(t, n) for t, n in r.arrivals if start < t <= end]
            tokens += sum(n for _, n in inside)
            # Gaps that end inside the window and start at or after its beginning.
            span = [(t, n) for t, n in r.arrivals if start <= t <= end]
            part = RequestTiming(0.0, 0.0, span)
            gaps += part.gaps_s()
            if part.tpot_s is not None:
                tpots.append(part.tpot_s)
    return {
        "decode_tokens_per_s": tokens / seconds if seconds > 0 else None,
        "decode_tpot_p50_ms": _ms(percentile(tpots, 50)),
        "decode_tpot_p99_ms": _ms(percentile(tpots, 99)),
        "decode_itl_p50_ms": _ms(percentile(gaps, 50)),
        "decode_itl_p99_ms": _ms(percentile(gaps, 99)),
        "decode_window_s": seconds,
    }


def summarize(batches: list[tuple[float, list[RequestTiming]]]) -> dict:
    """Throughput and latency of measured batches, each given as (wall seconds, requests):
    end to end (prefill included), then decode alone (``decode_summary``)."""
    requests = [r for _, batch in batches for r in batch]
    wall = sum(w for w, _ in batches)
    tokens = sum(r.tokens for r in requests)
    tpots = [r.tpot_s for r in requests if r.tpot_s is not None]
    gaps = [g for r in requests for g in r.gaps_s()]
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    return {
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "tpot_p50_ms": _ms(percentile(tpots, 50)), "tpot_p99_ms": _ms(percentile(tpots, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)), "itl_p99_ms": _ms(percentile(gaps, 99)),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "output_tokens": tokens, "requests": len(requests), "wall_s": wall,
        **decode_summary(batches),
    }


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def faster(results: dict[str, dict], key: str = "tokens_per_s") -> tuple[str, dict] | None:
    """The configuration with the most tokens/s (by ``key``; None if none has a number)."""
    ranked = [(r[key], name) for name, r in results.items() if r and r.get(key) is not None]
    if not ranked:
        return None
    name = max(ranked)[1]
    return name, results[name]


def eta(m: int, moe_layers: int, t_a_ms: float | None, t_e_ms: float | None,
        t_step_ms: float | None) -> float | None:
    if t_a_ms is None or t_e_ms is None or not t_step_ms:
        return None
    return m * moe_layers * max(t_a_ms, t_e_ms) / t_step_ms


def ideal_step_ms(m: int, moe_layers: int, t_a_ms: float | None, t_e_ms: float | None,
                  t_step_ms: float | None, decode_step_ms: float | None) -> float | None:
    """The decode step AFD would take with perfect overlap and no split cost: the busier role's
    work of every (MoE layer, micro-batch), ``m * L * max(t_a, t_e)``, plus what the step does
    outside the model forward (scheduling, sampling: the measured step less the forward)."""
    if None in (t_a_ms, t_e_ms, t_step_ms, decode_step_ms):
        return None
    return m * moe_layers * max(t_a_ms, t_e_ms) + max(0.0, decode_step_ms - t_step_ms)


def balance_context(per_step: dict[int, tuple[float | None, float | None]]) -> int | None:
    """The context whose (attention compute, FFN compute) per step are closest in ratio."""
    ranked = [(abs(math.log(a / e)), c) for c, (a, e) in per_step.items() if a and e]
    return min(ranked)[1] if ranked else None


MAX_HINT_M = 8


def sizing_hint(t_a_ms: float | None, t_e_ms: float | None, roundtrip_ms: float | None, m: int,
                attention_per_ffn: float) -> dict | None:
    """Which ``m`` would hide the transfers and which A:F ratio would balance the roles, for this
    model and load, from one configuration's per-(MoE layer, micro-batch) times.

    A layer's work, ``W = m * max(t_a, t_e)``, is taken to split evenly over the micro-batches
    and the transfer ``t_c`` (the round trip less the FFN compute in it) not to shrink with them.
    A layer then takes at least ``W``; the transfers of two micro-batches hide behind the others'
    compute when ``2 t_c <= (m' - 2) W / m'``, so the hint is the smallest such ``m'`` (None: no
    ``m'`` up to ``MAX_HINT_M`` does, the transfer is too long for the compute). An FFN rank's
    work grows with the attention ranks per FFN rank and an attention rank's does not, so
    ``A/F * t_a / t_e`` balances them. None without the times.
    """
    if t_a_ms is None or t_e_ms is None or roundtrip_ms is None or t_a_ms <= 0 or t_e_ms <= 0:
        return None
    t_c = max(0.0, roundtrip_ms - t_e_ms)
    work = m * max(t_a_ms, t_e_ms)
    best = next((k for k in range(2, MAX_HINT_M + 1) if 2 * t_c <= (k - 2) * work / k), None)
    return {"transfer_ms": t_c, "layer_compute_ms": work, "best_m": best,
            "balanced_attention_per_ffn": attention_per_ffn * t_a_ms / t_e_ms}


def describe_sizing(hint: dict, attention_per_ffn: float) -> str:
    """The hint as afd-bench prints it."""
    overlap = (f"m = {hint['best_m']} hides the transfers" if hint["best_m"] is not None else
               f"no m up to {MAX_HINT_M} hides the transfers (cut the bytes per layer or use a "
               "faster link first)")
    return (f"{overlap} ({hint['transfer_ms']:.2f} ms per layer against "
            f"{hint['layer_compute_ms']:.2f} ms of compute); attention:FFN ranks "
            f"{hint['balanced_attention_per_ffn']:.2f}:1 would balance the roles "
            f"(measured at {attention_per_ffn:.2f}:1)")


def split_verdict(afd: dict[int, dict], ratio_key: str) -> tuple[dict[int, dict], str] | None:
    """What splitting a step into micro-batches measurably cost, which the sizing hint cannot
    know: each m's compute per step on each role against the smallest m measured (on CPU each
    micro-batch reads the weights it touches again), and the m that came out fastest. ``afd``:
    m -> that configuration's entry. Returns (m -> {"attention": growth, "ffn": growth} for the
    split runs, the line afd-bench prints); None with fewer than two m measured."""
    keys = ("attention_compute_ms_per_step", "ffn_compute_ms_per_step")
    ok = {m: e for m, e in afd.items() if e.get("status") == "ok"
          and all(e.get(k) for k in keys) and e.get(ratio_key) is not None}
    if len(ok) < 2:
        return None
    base_m, *split = sorted(ok)
    base = ok[base_m]
    costs = {m: {role: ok[m][k] / base[k] - 1 for role, k in zip(("attention", "ffn"), keys)}
             for m in split}
    best = max(ok, key=lambda m: ok[m][ratio_key])
    parts = ", ".join(f"m = {m} attention {c['attention']:+.0%} / FFN {c['ffn']:+.0%}"
                      for m, c in costs.items())
    line = (f"split cost (compute per step against m = {base_m}): {parts}; fastest measured: "
            f"m = {best} ({ok[best][ratio_key]:.2f}x colocated)")
    return costs, line


def mark_split_cost(afd: dict[int, dict]) -> str | None:
    """``split_verdict`` against colocated throughput, each split run's cost kept in its entry
    (``split_cost`` in bench.json); the line to print, if any."""
    verdict = split_verdict(afd, "ratio_vs_colocated")
    if verdict is None:
        return None
    for m, cost in verdict[0].items():
        afd[m]["split_cost"] = cost
    return verdict[1]


def moe_layer_count(config: dict) -> int:
    """MoE layers of a Hugging Face config (Qwen3-MoE or DeepSeek-V2/V3)."""
    layers = int(config["num_hidden_layers"])
    if config.get("model_type") == "qwen3_moe":
        if not config.get("num_experts"):
            return 0
        dense = set(config.get("mlp_only_layers") or [])
        step = int(config.get("decoder_sparse_step") or 1)
        return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if config.get("n_routed_experts"):
        first = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        return sum(1 for i in range(layers) if i >= first and i % freq == 0)
    raise ValueError(f"cannot tell the MoE layers of model_type {config.get('model_type')!r}")


# (field, histogram, role): each field is the histogram's mean observation in ms.
AFD_FIELDS = [
    ("t_a_ms", "afd_attention_compute_seconds", "attention"),
    ("t_c_ms", "afd_wait_seconds", "attention"),
    ("roundtrip_ms", "afd_layer_roundtrip_seconds", "attention"),
    ("t_step_ms", "afd_step_seconds", "attention"),
    ("t_e_ms", "afd_ffn_compute_seconds", "ffn"),
    ("ffn_wait_ms", "afd_wait_seconds", "ffn"),
]
AFD_KEYS = [f for f, _, _ in AFD_FIELDS] + ["bytes_per_step", "bytes_sent_per_step",
                                            "bytes_received_per_step", "steps", "eta"]


def afd_breakdown(scrapes: dict[str, tuple[list, list]], m: int,
                  moe_layers: int) -> tuple[dict, list[str]]:
    """Per-layer breakdown from (before, after) scrapes of each role's /metrics.

    Returns the fields and the names of the metrics that were missing (their fields are None).
    """
    out: dict = {}
    missing = []
    for key, metric, role in AFD_FIELDS:
        before, after = scrapes.get(role, ([], []))
        out[key] = prom.mean_ms(before, after, metric, role=role)
        if out[key] is None:
            missing.append(f"{metric}{{role={role}}}")
    before, after = scrapes.get("attention", ([], []))
    steps = prom.delta(before, after, "afd_step_seconds_count", role="attention")
    out["steps"] = steps
    # Per step: where the attention role's step time went, and how busy the FFN role was.
    calls = prom.delta(before, after, "afd_layer_roundtrip_seconds_count", role="attention")
    items = prom.delta(*scrapes.get("ffn", ([], [])), "afd_ffn_compute_seconds_count", role="ffn")
    for key, mean, count in (("attention_compute_ms_per_step", "t_a_ms", calls),
                             ("attention_wait_ms_per_step", "t_c_ms", calls),
                             ("ffn_compute_ms_per_step", "t_e_ms", items)):
        out[key] = (out[mean] * count / steps if out[mean] is not None and count and steps
                    else None)
    for direction in ("sent", "received"):
        moved = prom.delta(before, after, "afd_bytes_total", role="attention",
                           direction=direction)
        if moved is None:
            missing.append(f"afd_bytes_total{{role=attention,direction={direction}}}")
        out[f"bytes_{direction}_per_step"] = moved / steps if moved is not None and steps else None
    sent, received = out["bytes_sent_per_step"], out["bytes_received_per_step"]
    out["bytes_per_step"] = None if sent is None or received is None else sent + received
    out["eta"] = eta(m, moe_layers, out["t_a_ms"], out["t_e_ms"], out["t_step_ms"])
    out["rows_per_ffn_rank"], out["ffn_rank_imbalance"] = ffn_rank_load(*scrapes.get("ffn",
                                                                                     ([], [])))
    return out, missing


def ffn_rank_load(before: list, after: list) -> tuple[list[int], float | None]:
    """Rows each FFN rank received in the window (``afd_routed_rows_total``), and the imbalance
    max / mean over the ranks (1.0: perfectly even); ([], None) without the series."""
    ranks = sorted({int(s.labels["ffn_rank"]) for s in after
                    if s.name == "afd_routed_rows_total" and "ffn_rank" in s.labels})
    rows = [int(prom.delta(before, after, "afd_routed_rows_total", role="ffn",
                           ffn_rank=str(f)) or 0) for f in ranks]
    if not rows or not sum(rows):
        return rows, None
    return rows, max(rows) / (sum(rows) / len(rows))
