"""End-to-end fixtures: tiny checkpoints and real `vllm serve` processes, shared per session.

Every AFD server pair runs each role on its own core (attention on core 0, FFN on core 1); the
colocated reference runs alone. Servers are stopped at the end of the test that started them, and
the stop itself is checked (no process of either role may survive).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import sys
from pathlib import Path

import pytest

from afd_common.launch import PROMPTS, Server, afd_args, complete, wait_gone
from afd_common.placement import expert_owners
from afd_common.selftest import free_port
from afd_common.tiny_model import write_tiny_model

pytestmark = pytest.mark.e2e
NUM_PROMPTS = 16
ARCHS = ("deepseek_v2", "qwen3_moe")
# Routed experts per checkpoint: 8 for DeepSeek-V2 (3 FFN ranks do not divide it; CAMAsync's
# ops need an even share, 2 ranks do), 7 for Qwen3-MoE (2 FFN ranks do not divide it).
NUM_EXPERTS = {"deepseek_v2": 8, "qwen3_moe": 7}
# The negative controls: Qwen3-MoE over 2 sharded FFN ranks with one rank's share reseeded.
SHARDED_CONTROL_RANKS = 2


_plugins = None


def say(msg: str) -> None:
    """Progress and measurements, shown live: pytest's capture is lifted for the one line."""
    if _plugins is None:
        print(f"[e2e] {msg}", file=sys.stderr, flush=True)
        return
    capture, reporter = _plugins
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"[e2e] {msg}")


@pytest.fixture(scope="session", autouse=True)
def _live_output(request):
    global _plugins
    manager = request.config.pluginmanager
    _plugins = (manager.get_plugin("capturemanager"), manager.get_plugin("terminalreporter"))
    yield
    _plugins = None


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {arch: write_tiny_model(arch, root / arch, seed=0, num_experts=NUM_EXPERTS[arch])
           for arch in ARCHS}
    # Same weights except the routed experts that one FFN rank owns: the negative controls.
    owners = expert_owners(NUM_EXPERTS["qwen3_moe"], SHARDED_CONTROL_RANKS, "linear")
    for f in range(SHARDED_CONTROL_RANKS):
        out[f"qwen3_moe-other-experts-f{f}"] = write_tiny_model(
            "qwen3_moe", root / f"qwen3-other-f{f}", seed=0, experts_seed=12345,
            num_experts=NUM_EXPERTS["qwen3_moe"],
            reseed_experts=[e for e, r in enumerate(owners) if r == f])
    return {k: Path(v) for k, v in out.items()}


def mixed_load() -> list[tuple[str, int]]:
    """64 requests of mixed prompt and output lengths."""
    words = "alpha beta gamma delta river stone cloud light north seven".split()
    return [(" ".join(words[(i * 3 + j) % 10] for j in range(1 + i % 9)), 4 + (i * 7) % 29)
            for i in range(64)]


def run_mixed(server: Server) -> list[list[str]]:
    """Send the whole mixed load at once, one request each; token ids in request order."""
    def one(item):
        prompt, n = item
        return complete(server, [prompt], max_tokens=n)[0]["tokens"]
    with cf.ThreadPoolExecutor(64) as pool:
        return list(pool.map(one, mixed_load()))


@pytest.fixture(scope="session")
def colocated(models, logs) -> dict[str, list]:
    """The reference: a plain colocated `vllm serve` per checkpoint, same flags, same prompts;
    ``"<arch>-mixed"`` holds the answers to the 64-request mixed load, ``"<arch>-rss"`` the
    server's resident memory after answering."""
    answers = {}
    # Both references at once, one core each: start-up is most of their cost.
    servers = {arch: Server(f"colocated-{arch}", str(models[arch]), free_port(),
                            logs / f"colocated-{arch}.log", cores=str(core)).start()
               for core, arch in enumerate(ARCHS)}
    try:
        for arch, server in servers.items():
            server.wait_ready(progress=say)
            answers[arch] = complete(server, PROMPTS[:NUM_PROMPTS])
            answers[f"{arch}-rss"] = server.rss_bytes()
            if arch == "deepseek_v2":
                answers[f"{arch}-mixed"] = run_mixed(server)
    finally:
        for server in servers.values():
            assert server.stop(), f"colocated server left processes:\n{server.log_tail()}"
    return answers


class Pair:
    def __init__(self, ffn: Server, attention: Server):
        self.ffn, self.attention = ffn, attention

    @property
    def servers(self):
        return (self.ffn, self.attention)


def dp_args(ranks: int) -> list[str]:
    return ["--data-parallel-size", str(ranks)] if ranks > 1 else []


@contextlib.contextmanager
def afd_pair(name: str, logs: Path, attn_model: Path, ffn_model: Path | None = None,
             num_attention_ranks: int = 1, num_ffn_ranks: int = 1,
             vllm_args: tuple[str, ...] = (), env: dict | None = None, **afd):
    """Start an FFN and an attention `vllm serve`, wait until both are ready; afterwards stop
    whatever the test left running. ``vllm_args`` and ``env`` go to both roles (e.g.
    ``--enable-expert-parallel``, ``AFD_TEST_INORDER``)."""
    port = free_port()
    ranks = {"num_attention_ranks": num_attention_ranks, "num_ffn_ranks": num_ffn_ranks}
    # FFN DP ranks start on core 1 and alternate, so 1A2F puts one FFN rank beside attention.
    ffn = Server(f"{name}-ffn", str(ffn_model or attn_model), free_port(), logs / f"{name}-ffn.log",
                 args=afd_args("ffn", port, **ranks, **afd) + dp_args(num_ffn_ranks)
                 + list(vllm_args), env=dict(env or {}),
                 cores="|".join(str((i + 1) % 2) for i in range(num_ffn_ranks)))
    attn_args = (afd_args("attention", port, **ranks, **afd) + dp_args(num_attention_ranks)
                 + list(vllm_args))
    # One core per DP rank for the attention role (it shares core 1 with the FFN role then).
    attention = Server(f"{name}-attention", str(attn_model), free_port(),
                       logs / f"{name}-attention.log", args=attn_args, env=dict(env or {}),
                       cores="|".join(str(i % 2) for i in range(num_attention_ranks)))
    pair = Pair(ffn.start(), attention.start())
    try:
        attention.wait_ready(progress=say, others=(ffn,))
        ffn.wait_ready(progress=say, others=(attention,))
        yield pair
    finally:
        for server in pair.servers:
            server.signal()
        wait_gone(pair.servers, 30)
        for server in pair.servers:
            server.stop(timeout_s=1)
