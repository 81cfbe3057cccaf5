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
from afd_common.selftest import free_port
from afd_common.tiny_model import write_tiny_model

pytestmark = pytest.mark.e2e
NUM_PROMPTS = 16
ARCHS = ("deepseek_v2", "qwen3_moe")


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
    out = {arch: write_tiny_model(arch, root / arch, seed=0) for arch in ARCHS}
    # Same weights except the routed experts: the negative control's FFN checkpoint.
    out["deepseek_v2-other-experts"] = write_tiny_model("deepseek_v2", root / "dsv2-other",
                                                        seed=0, experts_seed=12345)
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


@contextlib.contextmanager
def afd_pair(name: str, logs: Path, attn_model: Path, ffn_model: Path | None = None,
             num_attention_ranks: int = 1, **afd):
    """Start an FFN and an attention `vllm serve`, wait until both are ready; afterwards stop
    whatever the test left running."""
    port = free_port()
    ranks = {"num_attention_ranks": num_attention_ranks}
    ffn = Server(f"{name}-ffn", str(ffn_model or attn_model), free_port(), logs / f"{name}-ffn.log",
                 args=afd_args("ffn", port, **ranks, **afd), cores="1")
    attn_args = afd_args("attention", port, **ranks, **afd)
    if num_attention_ranks > 1:
        attn_args += ["--data-parallel-size", str(num_attention_ranks)]
    # One core per DP rank for the attention role (it shares core 1 with the FFN role then).
    attention = Server(f"{name}-attention", str(attn_model), free_port(),
                       logs / f"{name}-attention.log", args=attn_args,
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
