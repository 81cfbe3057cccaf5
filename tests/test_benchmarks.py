"""The benchmark scripts run: they drive the connector primitives directly, so a change of the
contract that the suite's other callers follow must reach them too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def table(stdout: str) -> list[tuple]:
    """The ratio table's rows: T, connector ms, raw ms, ratio, steady, served, bare, floor and
    twin ratios, the Python path's ratio (or --), first layer us connector/floor/raw back to
    back, connector/raw served."""
    return re.findall(r"^\s+(\d+)" + r"\s+([\d.]+)" * 8 + r"\s+(--|[\d.]+)"
                      + r"\s+(\d+)/(\d+)/(\d+)\s+(\d+)/(\d+)\s*$", stdout, re.M)


def test_transport_benchmark_round_trips_and_prints_the_ratio_per_size():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "transport.py"), "--layers", "2",
                          "--reps", "2", "--tokens", "1", "16", "--breakdown"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = table(out.stdout)
    assert [int(r[0]) for r in rows] == [1, 16], out.stdout
    # --breakdown times the Python path: no compiled one beside it
    assert "one-link path: Python (AFD_ONE_LINK=0, for --breakdown" in out.stdout
    assert all(r[9] == "--" for r in rows), out.stdout
    assert all(float(v) > 0 for r in rows for v in r[1:9] + r[10:]), out.stdout
    assert "worst ratio" in out.stdout
    # Each leg of a layer's round trip, for the connector and the raw loop, at each size.
    legs = re.findall(r"^  (\S.*?)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+([+-][\d.]+)$", out.stdout,
                      re.M)
    assert [leg[0] for leg in legs[:6]] == [
        "attention: send call", "wire to the FFN side", "FFN: rows in hand -> send issued",
        "FFN: send call", "wire back", "attention: result in hand -> next send issued"], out.stdout
    assert len(legs) == 2 * 6, out.stdout


def test_transport_benchmark_prints_each_sides_cpu_per_layer_without_breakdown():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "transport.py"), "--layers", "2",
                          "--reps", "2", "--tokens", "1", "16"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # T, then connector / bare loop for the attention side and for the FFN side
    cpu = re.findall(r"^\s+(\d+)" + r"\s+([\d.]+) / ([\d.]+)" * 2 + r"\s*$", out.stdout, re.M)
    assert [int(r[0]) for r in cpu] == [1, 16], out.stdout
    assert all(float(v) > 0 for r in cpu for v in r[1:]), out.stdout
    assert "where a layer's round trip goes" not in out.stdout
    # The compiled path, and its Python path beside it
    assert "one-link path: compiled" in out.stdout
    assert [float(r[9]) > 0 for r in table(out.stdout)] == [True, True], out.stdout


def test_transport_benchmark_cpu_mode_prints_each_halfs_python_per_layer():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "transport.py"), "--cpu", "--tokens",
                          "1", "16"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # T, attention, bare, extra, FFN, bare, extra (us)
    rows = re.findall(r"^\s+(\d+)" + r"\s+([+-]?[\d.]+)" * 6 + r"\s*$", out.stdout, re.M)
    assert [int(r[0]) for r in rows] == [1, 16], out.stdout
    for r in rows:
        attention, bare_a, extra_a, ffn, bare_f, extra_f = map(float, r[1:])
        assert attention > 0 and bare_a > 0 and ffn > 0 and bare_f > 0, out.stdout
        assert abs(attention - bare_a - extra_a) < 0.02 and abs(ffn - bare_f - extra_f) < 0.02
