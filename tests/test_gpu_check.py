"""scripts/gpu-check.sh on a machine without a GPU: its help, and its code path up to the first
CUDA call (vLLM starting on the device) with a fake CUDA platform, so it does not rot."""

import json
import subprocess
from pathlib import Path

import pytest

from afd_common.tools import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_help_works_without_a_gpu():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--help"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "NCCL" in out.stdout and "afd-bench --quick" in out.stdout


def test_refuses_without_cuda(tmp_path, capsys):
    args = gpu_check.main.__globals__["argparse"].Namespace(
        out=tmp_path, base_port=29700, ready_timeout=1, skip_bench=True)
    assert gpu_check.run(args, cuda=lambda: False) == 2
    assert "no CUDA device" in capsys.readouterr().err


class FirstCudaCall(Exception):
    pass


def test_everything_up_to_the_first_cuda_call(tmp_path):
    started = []

    def start(server):
        started.append(server)
        raise FirstCudaCall

    args = gpu_check.main.__globals__["argparse"].Namespace(
        out=tmp_path, base_port=29700, ready_timeout=1, skip_bench=True)
    with pytest.raises(FirstCudaCall):
        gpu_check.run(args, cuda=lambda: True, start=start)
    # The checkpoints were written; the first server is a colocated one on the GPU settings.
    for arch in ("deepseek_v2", "qwen3_moe"):
        assert (tmp_path / arch / "model.safetensors").exists()
    first = started[0]
    assert first.name.startswith("colocated-")
    assert "0.35" in first.common_args and "--enforce-eager" not in first.common_args
    # Every AFD case: both roles, same afd port, P2P (NCCL is its CUDA default), m as planned.
    ports = iter(range(30000, 30100))
    models = {a: tmp_path / a for a in ("deepseek_v2", "qwen3_moe")}
    cases = gpu_check.plan(models, tmp_path / "logs", ports)
    assert {c.m for c, _, _ in cases} == {1, 2}
    assert {c.gate_on_attention for c, _, _ in cases} == {True, False}
    for case, ffn, attention in cases:
        afd = [json.loads(s.args[s.args.index("--additional-config") + 1])["afd"]
               for s in (ffn, attention)]
        assert [a["role"] for a in afd] == ["ffn", "attention"]
        assert afd[0]["port"] == afd[1]["port"] and afd[0]["connector"] == "P2pAFDConnector"
        assert afd[0]["connector_extra_config"]["num_micro_batches"] == case.m
        assert "backend" not in afd[0]["connector_extra_config"]
