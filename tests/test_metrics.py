"""The AFD series as vLLM's /metrics renders them: names, labels, cumulative buckets, merging."""

from __future__ import annotations

import pytest

from afd_common import metrics
from afd_common.metrics import BUCKETS, Recorder


def render(*snaps) -> dict[str, float]:
    text = metrics.render(list(snaps)).decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_histograms_and_bytes_render_with_role_and_connector():
    rec = Recorder("attention", "P2pAFDConnector")
    for seconds in (2e-5, 3e-4, 3e-4, 20.0):
        rec.roundtrip(seconds)
    rec.moved(sent=100, received=60)
    series = render(rec.snapshot())
    labels = 'connector="P2pAFDConnector",role="attention"'
    assert series[f"afd_layer_roundtrip_seconds_count{{{labels}}}"] == 4
    assert series[f"afd_layer_roundtrip_seconds_sum{{{labels}}}"] == pytest.approx(20.00062)
    # Cumulative, "less or equal" buckets; 20 s lands only in +Inf.
    def bucket(le: str) -> float:
        return series[f'afd_layer_roundtrip_seconds_bucket{{connector="P2pAFDConnector",'
                      f'le="{le}",role="attention"}}']

    assert [bucket("2.5e-05"), bucket("0.0005"), bucket("10.0"), bucket("+Inf")] == [1, 3, 3, 4]
    assert series[f'afd_bytes_total{{connector="P2pAFDConnector",direction="sent",'
                  f'role="attention"}}'] == 100
    # Series that saw nothing are not rendered.
    assert not any(k.startswith("afd_ffn_compute_seconds") for k in series)


def test_snapshots_of_several_workers_add_up():
    a, b = Recorder("ffn", "P2pAFDConnector"), Recorder("ffn", "P2pAFDConnector")
    a.ffn_compute(1e-3)
    b.ffn_compute(2e-3)
    b.ffn_compute(BUCKETS[-1] * 2)
    idle = {"labels": {"role": "ffn", "connector": "X"}, "histograms": {}, "bytes": {}}
    series = render(a.snapshot(), b.snapshot(), idle)
    assert series['afd_ffn_compute_seconds_count{connector="P2pAFDConnector",role="ffn"}'] == 3
    assert series['afd_ffn_compute_seconds_bucket{connector="P2pAFDConnector",le="0.0025",'
                  'role="ffn"}'] == 2
    assert not any('connector="X"' in k for k in series)


def test_openmetrics_rendering_leaves_the_eof_to_the_response_it_joins():
    rec = Recorder("ffn", "P2pAFDConnector")
    rec.wait(0.01)
    rec.moved(sent=8)
    text = metrics.render([rec.snapshot()], openmetrics=True).decode()
    assert "afd_wait_seconds_count" in text and "afd_bytes_total" in text
    assert "# EOF" not in text


def test_device_timer_observes_completed_work_without_synchronizing(monkeypatch):
    """On CUDA the FFN compute is timed with events, read once the GPU passed them; a query
    that says 'not yet' defers the observation instead of blocking."""
    import torch

    from afd_common.metrics import DeviceTimer

    clock = {"t": 0.0, "done_until": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.at = clock["t"]

        def query(self):
            return self.at <= clock["done_until"]

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    seen = []
    timer = DeviceTimer(torch.device("cuda", 1))
    start = timer.start()
    clock["t"] = 0.25
    timer.stop(start, seen.append)  # the GPU is not there yet: nothing observed
    assert seen == []
    clock["done_until"], clock["t"] = 1.0, 1.0
    start = timer.start()
    clock["t"] = 1.5
    timer.stop(start, seen.append)  # the first pair completed; the second not yet
    assert seen == [0.25]
    cpu = DeviceTimer(torch.device("cpu"))
    cpu.stop(cpu.start(), seen.append)
    assert len(seen) == 2 and 0 <= seen[1] < 1
