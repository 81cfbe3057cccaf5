"""``scripts/gpu-check.sh``: the first run of afd on a CUDA machine, in one command.

No machine this project is built on has a GPU, so the CUDA path (NCCL data plane, CUDA graphs
split around the remote call, device-bound threads, bounded device waits) is written to the same
contract as the CPU path and unit-tested on CPU, but has not run. This script is what runs it: on
one GPU, both roles of each AFD pair share the device (``--gpu-memory-utilization 0.35`` each),
the P2P connector moves the rows over NCCL, and each case must give the colocated server's
tokens (logprobs within 1e-3) for the same checkpoint. Then ``afd-bench --quick``. One summary
line at the end; exit status 0 only when every case matched.

Not part of CI. Everything up to the first CUDA call (the plan, the checkpoints, the server
command lines) is exercised on CPU by ``tests/test_gpu_check.py`` with a fake platform.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from afd_common.tools.launch import PROMPTS, Server, afd_args, compare, complete, wait_gone
from afd_common.tools.tiny_model import write_tiny_model

# Both roles on one GPU; CUDA graphs allowed (no --enforce-eager): the attention role captures
# piecewise graphs around the remote call, the FFN role runs eager.
GPU_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--gpu-memory-utilization", "0.35",
            "--seed", "0", "--max-num-seqs", "64"]
NUM_PROMPTS = 16


@dataclass(frozen=True)
class Case:
    arch: str
    gate_on_attention: bool
    m: int

    @property
    def name(self) -> str:
        return (f"{self.arch}-gate_on_{'attention' if self.gate_on_attention else 'ffn'}-"
                f"m{self.m}")


CASES = (Case("deepseek_v2", True, 1), Case("deepseek_v2", False, 2),
         Case("qwen3_moe", False, 1), Case("qwen3_moe", True, 2))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def server_for(name: str, model: Path, port: int, logs: Path, args: list[str]) -> Server:
    return Server(name, str(model), port, logs / f"{name}.log", args=args,
                  common_args=list(GPU_ARGS), device="cuda")


def plan(models: dict[str, Path], logs: Path, ports) -> list[tuple[Case, Server, Server]]:
    """Each case's (FFN server, attention server), not started: the NCCL backend is the P2P
    connector's default on CUDA, so the afd sections carry nothing CUDA-specific."""
    out = []
    for case in CASES:
        afd_port = next(ports)
        extra = {"compute_gate_on_attention": case.gate_on_attention,
                 "connector_extra_config": {"num_micro_batches": case.m}}
        out.append((case,
                    server_for(f"{case.name}-ffn", models[case.arch], next(ports), logs,
                               afd_args("ffn", afd_port, **extra)),
                    server_for(f"{case.name}-attention", models[case.arch], next(ports), logs,
                               afd_args("attention", afd_port, **extra))))
    return out


def run(args, cuda=cuda_available, start=Server.start) -> int:
    if not cuda():
        print("gpu-check: no CUDA device here; this script is for a GPU machine (see --help)",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    work = Path(args.out or tempfile.mkdtemp(prefix="afd-gpu-check-"))
    logs = work / "logs"
    models = {arch: write_tiny_model(arch, work / arch, seed=0)
              for arch in sorted({c.arch for c in CASES})}
    ports = iter(range(args.base_port, args.base_port + 100))
    cases = plan(models, logs, ports)
    colocated = {arch: server_for(f"colocated-{arch}", path, next(ports), logs, [])
                 for arch, path in models.items()}
    refs: dict[str, list] = {}
    for arch, server in colocated.items():  # the first CUDA call: vLLM starts on the GPU
        start(server)
        try:
            server.wait_ready(args.ready_timeout)
            refs[arch] = complete(server, PROMPTS[:NUM_PROMPTS])
        finally:
            server.stop()
    results = []
    for case, ffn, attention in cases:
        start(ffn), start(attention)
        try:
            attention.wait_ready(args.ready_timeout, others=(ffn,))
            problems = compare(complete(attention, PROMPTS[:NUM_PROMPTS]), refs[case.arch])
            results.append((case.name, not problems, problems[:3]))
        except Exception as e:  # noqa: BLE001 - reported in the summary, with the log paths
            results.append((case.name, False, [f"{type(e).__name__}: {e}"[:300]]))
        finally:
            for server in (attention, ffn):
                server.signal()
            wait_gone([attention, ffn], 60)
            for server in (attention, ffn):
                server.stop(5)
        print(f"gpu-check: {results[-1][0]}: {'ok' if results[-1][1] else 'DIFFERS'} "
              f"{results[-1][2] or ''}", flush=True)
    bench = "skipped"
    if not args.skip_bench:
        done = subprocess.run([str(Path(sys.executable).with_name("afd-bench")), "--quick",
                               "--out", str(work / "bench")], check=False)
        bench = "ok" if done.returncode == 0 else f"failed ({done.returncode})"
    passed = sum(ok for _, ok, _ in results)
    print(f"gpu-check: {passed}/{len(results)} AFD cases gave the colocated tokens over NCCL; "
          f"afd-bench --quick {bench}; {time.monotonic() - t0:.0f} s; logs in {logs}")
    return 0 if passed == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="gpu-check", description=__doc__.split("\n\n")[1],
        epilog="Runs: colocated vLLM and AFD (P2P over NCCL) on tiny DeepSeek-V2 and Qwen3-MoE "
        "checkpoints, for " + ", ".join(c.name for c in CASES) + "; then afd-bench --quick.")
    ap.add_argument("--out", type=Path, help="work folder (default: a new temporary one)")
    ap.add_argument("--base-port", type=int, default=29700)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--skip-bench", action="store_true")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
