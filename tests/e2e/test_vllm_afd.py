"""Two `vllm serve` roles give the colocated answer; a wrong FFN gives another; stops are clean."""

from __future__ import annotations

import json
import signal
import time

import pytest

from afd_common.launch import PROMPTS, compare, complete, wait_gone
from afd_common.lifecycle import FAILED_EXIT_CODE

from .conftest import NUM_PROMPTS, afd_pair, say

pytestmark = pytest.mark.e2e


def weights(server) -> dict:
    line = next(line for line in server.log_path.read_text().splitlines()
                if "AFD weights:" in line)
    return json.loads(line.split("AFD weights:", 1)[1])["by_category"]


# (checkpoint, gate on the attention side, attention ranks, connector, micro-batches): one case
# is the multi-rank topology 2 attention ranks : 1 FFN rank, where the FFN rank serves both; the
# CAM connectors move the rows through the afd_ascend ops (portable kernels over Gloo), CAMAsync
# with async DP and the FFN role's receive loop as the clock. Micro-batching (m = 2, 3) rides on
# cases that exist anyway: the answers must not change with m.
CASES = [("deepseek_v2", True, 1, "P2pAFDConnector", 1),
         ("deepseek_v2", False, 2, "P2pAFDConnector", 2),
         ("qwen3_moe", True, 1, "P2pAFDConnector", 3),
         ("qwen3_moe", False, 1, "P2pAFDConnector", 2),
         ("deepseek_v2", True, 1, "CAMP2pAFDConnector", 2),
         ("deepseek_v2", True, 2, "CAMAsyncAFDConnector", 1)]
ASYNC = {"async_dp": True, "connector_extra_config": {"ops_backend": "portable"}}


@pytest.mark.parametrize("arch,gate_on_attention,num_attention_ranks,connector,m", CASES,
                         ids=[f"{a}-gate_on_{'attention' if g else 'ffn'}-{n}A1F-{c}-m{m}"
                              for a, g, n, c, m in CASES])
def test_afd_matches_colocated_then_sigterm_on_attention_ends_both(
        arch, gate_on_attention, num_attention_ranks, connector, m, models, colocated, logs):
    extra = ASYNC if connector == "CAMAsyncAFDConnector" else {}
    if m > 1:
        extra = {"connector_extra_config": {"num_micro_batches": m}}
    with afd_pair(f"{arch}-{gate_on_attention}-{num_attention_ranks}A-{connector}-m{m}", logs,
                  models[arch], num_attention_ranks=num_attention_ranks, connector=connector,
                  compute_gate_on_attention=gate_on_attention, **extra) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        problems = compare(answers, colocated[arch])
        assert not problems, "\n".join(problems)
        assert len(answers) == NUM_PROMPTS and all(len(a["tokens"]) == 32 for a in answers)
        if m > 1:  # the steps really were split (the prompts arrive together, so they can be)
            assert f"split into {m} micro-batches" in pair.attention.log_path.read_text()
        check_metrics(pair, connector, exact_counts=num_attention_ranks == 1)
        if num_attention_ranks > 1:
            log = pair.ffn.log_path.read_text()
            assert f"handshake with {num_attention_ranks} peers ok" in log

        # Role-pruned weights, counted by name on each side.
        attn, ffn = weights(pair.attention), weights(pair.ffn)
        say(f"{arch}: attention holds {sorted(attn)}, FFN holds {sorted(ffn)}; RSS attention "
            f"{pair.attention.rss_bytes() / 2**20:.0f} MiB, FFN {pair.ffn.rss_bytes() / 2**20:.0f}"
            f" MiB, colocated {colocated[f'{arch}-rss'] / 2**20:.0f} MiB")
        assert "routed_experts" not in attn and {"attention", "embedding", "lm_head"} <= set(attn)
        assert not {"attention", "embedding", "lm_head"} & set(ffn)
        assert ffn["routed_experts"]["tensors"] > 0

        # The FFN role's front end refuses generation and reports its loop.
        status = json.loads(_get(pair.ffn.url + "/health"))
        assert status["healthy"] and status["ranks"][0]["steps"] > 0
        with pytest.raises(Exception, match="400"):
            complete(pair.ffn, PROMPTS[:1])

        # Ctrl-C / SIGTERM on the attention server ends both roles, cleanly.
        sigterm_ends_both(pair, pair.attention)
        assert pair.attention.proc.returncode == 0, "the server stopped on purpose exits 0"
        assert pair.ffn.proc.returncode in (0, FAILED_EXIT_CODE)


def afd_series(server) -> dict[str, float]:
    """The afd_* samples of a server's /metrics, by name and labels."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in _get(server.url + "/metrics").splitlines() if line.startswith("afd_")}


def check_metrics(pair, connector: str, exact_counts: bool) -> None:
    """Both roles' /metrics carry the AFD series while serving; with one attention rank every
    attention round trip is one FFN work item, so the counts agree exactly."""
    def sample(series, name, role, **more):
        labels = ",".join(f'{k}="{v}"' for k, v in
                          sorted({"connector": connector, "role": role, **more}.items()))
        key = f"{name}{{{labels}}}"
        assert key in series, f"{key} missing from /metrics; AFD series: {sorted(series)}"
        return series[key]

    attn, ffn = afd_series(pair.attention), afd_series(pair.ffn)
    for name in ("afd_layer_roundtrip_seconds", "afd_attention_compute_seconds",
                 "afd_wait_seconds", "afd_step_seconds"):
        assert sample(attn, f"{name}_count", "attention") > 0
        assert sample(attn, f"{name}_sum", "attention") > 0
    assert sample(attn, "afd_bytes_total", "attention", direction="sent") > 0
    assert sample(ffn, "afd_ffn_compute_seconds_count", "ffn") > 0
    assert sample(ffn, "afd_wait_seconds_count", "ffn") > 0
    assert sample(ffn, "afd_bytes_total", "ffn", direction="received") > 0
    if exact_counts:
        assert (sample(attn, "afd_layer_roundtrip_seconds_count", "attention")
                == sample(ffn, "afd_ffn_compute_seconds_count", "ffn"))


def sigterm_ends_both(pair, server) -> None:
    """SIGTERM one server: both must be gone within 30 s. The peer exits 0 when the stopped
    role's worker said goodbye before vLLM's shutdown killed it, else 3 (a lost peer)."""
    start = time.monotonic()
    server.signal(signal.SIGTERM)
    assert wait_gone(pair.servers, 30), "\n".join(
        f"{s.name}: processes left {s.pids()}\n{s.log_tail()}" for s in pair.servers)
    say(f"SIGTERM on {server.name}: both roles gone after {time.monotonic() - start:.1f} s, "
        f"exit codes: attention {pair.attention.proc.returncode}, FFN {pair.ffn.proc.returncode}")


def _get(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_negative_control_and_sigterm_on_ffn_ends_both(models, colocated, logs):
    """An FFN role with other experts gives other answers (so equality above means something);
    then SIGTERM on the FFN server ends both roles within 30 s."""
    with afd_pair("dsv2-negative", logs, models["deepseek_v2"],
                  ffn_model=models["deepseek_v2-other-experts"]) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        differing = compare(answers, colocated["deepseek_v2"])
        assert len(differing) >= NUM_PROMPTS // 2, differing
        sigterm_ends_both(pair, pair.ffn)
        assert pair.ffn.proc.returncode == 0, "the server stopped on purpose exits 0"
        assert pair.attention.proc.returncode in (0, FAILED_EXIT_CODE)
