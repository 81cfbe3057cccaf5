"""Where the time of an AFD step goes, on vLLM's ``/metrics`` of each role.

The numbers are taken in the worker that runs the step (perf_counter around the calls it makes
anyway: no device sync, no extra message) into plain in-process histograms; observing costs
about a microsecond. vLLM serves ``/metrics`` from its API server, another process, so the API
server asks the workers for a snapshot at scrape time (``afd_metrics`` over vLLM's
``collective_rpc``, answered between steps) and adds them to the response
(afd_common.vllm_glue.patches.api_server). Nothing is written per step to any file or socket.

Series (``HISTOGRAMS`` below, in seconds, and the ``afd_bytes_total`` counter with a
``direction`` label), all labelled ``role`` and ``connector``. Expert load, what a balancer
needs: ``afd_routed_rows_total`` counts the rows that crossed to (attention) or arrived at (FFN)
each FFN rank (label ``ffn_rank``), and ``afd_expert_rows_total`` (FFN role, labels ``layer`` and
``expert``) the (token, expert) pairs each routed expert computed. A "call" is one (MoE layer,
micro-batch): the attention side records its compute before the send, the round trip and the
time blocked on the result, and the whole forward; the FFN side records expert compute per work
item and the time blocked waiting for work.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HISTOGRAMS = {
    "afd_layer_roundtrip_seconds": "AFD: attention send of one (MoE layer, micro-batch) until "
                                   "its FFN result is in hand",
    "afd_attention_compute_seconds": "AFD: attention-side compute of one (MoE layer, "
                                     "micro-batch) before its send",
    "afd_wait_seconds": "AFD: time blocked on the peer (attention: for a result; FFN: for work)",
    "afd_ffn_compute_seconds": "AFD: FFN-side expert compute of one work item",
    "afd_step_seconds": "AFD: one model forward on the attention role, all micro-batches",
}
BYTES = "afd_bytes"  # exported as afd_bytes_total
BYTES_HELP = "AFD: bytes of tensors moved between the roles"
ROUTED = "afd_routed_rows"
ROUTED_HELP = "AFD: rows sent to (attention role) or received by (FFN role) each FFN rank"
EXPERT = "afd_expert_rows"
EXPERT_HELP = "AFD: (token, expert) pairs computed by each routed expert, per MoE layer"


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1


class Recorder:
    """One role's series in one worker. Methods are cheap enough for every layer call."""

    def __init__(self, role: str, connector: str):
        self.labels = {"role": role, "connector": connector}
        self._h = {name: _Histogram() for name in HISTOGRAMS}
        self.bytes = {"sent": 0, "received": 0}
        self.routed_rows: dict[int, int] = {}
        self._routed_by_rank = None  # int64 tensor [FFN ranks], added to without a host sync
        self._expert_rows: dict[int, object] = {}  # layer -> int64 tensor [num_experts]
        self.roundtrip = self._h["afd_layer_roundtrip_seconds"].observe
        self.attention_compute = self._h["afd_attention_compute_seconds"].observe
        self.wait = self._h["afd_wait_seconds"].observe
        self.ffn_compute = self._h["afd_ffn_compute_seconds"].observe
        self.step = self._h["afd_step_seconds"].observe

    def moved(self, sent: int = 0, received: int = 0) -> None:
        self.bytes["sent"] += sent
        self.bytes["received"] += received

    def routed(self, ffn_rank: int, rows: int) -> None:
        self.routed_rows[ffn_rank] = self.routed_rows.get(ffn_rank, 0) + rows

    def routed_per_rank(self, counts) -> None:
        """Rows per FFN rank as a tensor (e.g. a bincount on the device): no host sync."""
        if self._routed_by_rank is None:
            self._routed_by_rank = counts.long().clone()
        else:
            self._routed_by_rank += counts

    def expert_pairs(self, layer: int, topk_ids, num_experts: int) -> None:
        """Count one item's (token, expert) pairs: a tensor add, no host sync."""
        import torch

        counts = self._expert_rows.get(layer)
        if counts is None:
            counts = self._expert_rows[layer] = torch.zeros(num_experts, dtype=torch.int64,
                                                            device=topk_ids.device)
        ids = topk_ids.flatten().long()
        counts += torch.bincount(ids[(ids >= 0) & (ids < num_experts)], minlength=num_experts)

    def snapshot(self) -> dict[str, Any]:
        """Plain data (it crosses vLLM's RPC): only the series that saw anything."""
        return {"labels": dict(self.labels),
                "histograms": {n: {"counts": list(h.counts), "sum": h.sum, "count": h.count}
                               for n, h in self._h.items() if h.count},
                "bytes": dict(self.bytes),
                "routed_rows": self._routed_snapshot(),
                "expert_rows": {str(layer): counts.tolist()
                                for layer, counts in self._expert_rows.items()}}


    def _routed_snapshot(self) -> dict[str, int]:
        out = dict(self.routed_rows)
        if self._routed_by_rank is not None:
            for f, n in enumerate(self._routed_by_rank.tolist()):
                out[f] = out.get(f, 0) + n
        return {str(f): n for f, n in sorted(out.items()) if n}


class DeviceTimer:
    """Times device work as completed work: CUDA events on CUDA (read back once the GPU passed
    them, never by synchronizing), the wall clock elsewhere, where kernels run synchronously."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._pending: list = []

    def start(self):
        if not self.cuda:
            import time

            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started, observe) -> None:
        """``observe(seconds)`` now (CPU) or once the device has finished the work (CUDA)."""
        if not self.cuda:
            import time

            observe(time.perf_counter() - started)
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((started, end, observe))
        while self._pending and self._pending[0][1].query():
            begin, finish, obs = self._pending.pop(0)
            obs(begin.elapsed_time(finish) / 1000.0)


_recorder: Recorder | None = None
_lock = threading.Lock()


def recorder(role: str, connector: str) -> Recorder:
    """This process's recorder (one role per process), created on first use."""
    global _recorder
    with _lock:
        if _recorder is None or _recorder.labels != {"role": role, "connector": connector}:
            _recorder = Recorder(role, connector)
        return _recorder


def snapshot() -> dict[str, Any] | None:
    return _recorder.snapshot() if _recorder is not None else None


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class MetricsWorkerMixin:
    """Gives a vLLM worker the ``afd_metrics`` method the API server calls at scrape time."""

    def afd_metrics(self) -> dict[str, Any] | None:
        return snapshot()


def render(snapshots: list[dict[str, Any]], openmetrics: bool = False) -> bytes:
    """The series of these worker snapshots in Prometheus text (or OpenMetrics, without its
    ``# EOF``), for the API server to add to vLLM's ``/metrics``."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(SnapshotCollector(snapshots))
    if openmetrics:
        from prometheus_client.openmetrics.exposition import generate_latest

        return generate_latest(registry).removesuffix(b"# EOF\n")
    from prometheus_client import generate_latest

    return generate_latest(registry)


class SnapshotCollector:
    """A prometheus_client collector over worker snapshots (API server side)."""

    def __init__(self, snapshots: list[dict[str, Any]]):
        self.snapshots = snapshots

    def describe(self):
        return []  # no fixed series: rendered from what the workers recorded

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        merged: dict[tuple, dict] = {}
        byte_totals: dict[tuple, int] = {}
        routed: dict[tuple, int] = {}
        expert: dict[tuple, int] = {}
        for snap in self.snapshots:
            labels = tuple(sorted(snap["labels"].items()))
            for name, h in snap["histograms"].items():
                acc = merged.setdefault((name, labels), {"counts": [0] * len(h["counts"]),
                                                         "sum": 0.0})
                acc["counts"] = [a + b for a, b in zip(acc["counts"], h["counts"])]
                acc["sum"] += h["sum"]
            for direction, n in snap["bytes"].items():
                key = labels + (("direction", direction),)
                byte_totals[key] = byte_totals.get(key, 0) + n
            for f, n in snap.get("routed_rows", {}).items():
                key = labels + (("ffn_rank", f),)
                routed[key] = routed.get(key, 0) + n
            for layer, counts in snap.get("expert_rows", {}).items():
                for e, n in enumerate(counts):
                    if n:
                        key = labels + (("expert", str(e)), ("layer", layer))
                        expert[key] = expert.get(key, 0) + n
        for name, doc in HISTOGRAMS.items():
            series = [(dict(lbl), acc) for (n, lbl), acc in merged.items() if n == name]
            if not series:
                continue
            family = HistogramMetricFamily(name, doc, labels=sorted(series[0][0]))
            for labels, acc in series:
                cumulative, buckets = 0, []
                for bound, n in zip([*map(str, BUCKETS), "+Inf"], acc["counts"]):
                    cumulative += n
                    buckets.append((bound, cumulative))
                family.add_metric([labels[k] for k in sorted(labels)], buckets, acc["sum"])
            yield family
        if byte_totals:
            family = CounterMetricFamily(BYTES, BYTES_HELP,
                                         labels=["connector", "direction", "role"])
            for key, n in byte_totals.items():
                lbl = dict(key)
                family.add_metric([lbl["connector"], lbl["direction"], lbl["role"]], n)
            yield family
        for name, doc, values in ((ROUTED, ROUTED_HELP, routed), (EXPERT, EXPERT_HELP, expert)):
            if not values:
                continue
            names = sorted(dict(next(iter(values))))
            family = CounterMetricFamily(name, doc, labels=names)
            for key, n in values.items():
                lbl = dict(key)
                family.add_metric([lbl[k] for k in names], n)
            yield family
