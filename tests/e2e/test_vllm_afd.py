"""Two `vllm serve` roles give the colocated answer; a wrong FFN gives another; stops are clean."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from afd_common.launch import PROMPTS, compare, complete, wait_gone

from .conftest import NUM_PROMPTS, afd_pair, say

pytestmark = pytest.mark.e2e


def weights(server) -> dict:
    line = next(line for line in server.log_path.read_text().splitlines()
                if "AFD weights:" in line)
    return json.loads(line.split("AFD weights:", 1)[1])["by_category"]


CASES = [("deepseek_v2", True), ("deepseek_v2", False), ("qwen3_moe", True),
         ("qwen3_moe", False)]


@pytest.mark.parametrize("arch,gate_on_attention", CASES,
                         ids=[f"{a}-gate_on_{'attention' if g else 'ffn'}" for a, g in CASES])
def test_afd_matches_colocated(arch, gate_on_attention, models, colocated, logs):
    with afd_pair(f"{arch}-{gate_on_attention}", logs, models[arch],
                  compute_gate_on_attention=gate_on_attention) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        problems = compare(answers, colocated[arch])
        assert not problems, "\n".join(problems)
        assert len(answers) == NUM_PROMPTS and all(len(a["tokens"]) == 32 for a in answers)

        # Role-pruned weights, counted by name on each side.
        attn, ffn = weights(pair.attention), weights(pair.ffn)
        say(f"{arch}: attention holds {sorted(attn)}, FFN holds {sorted(ffn)}; RSS attention "
            f"{pair.attention.rss_bytes() / 2**20:.0f} MiB, FFN {pair.ffn.rss_bytes() / 2**20:.0f}"
            " MiB")
        assert "routed_experts" not in attn and {"attention", "embedding", "lm_head"} <= set(attn)
        assert not {"attention", "embedding", "lm_head"} & set(ffn)
        assert ffn["routed_experts"]["tensors"] > 0

        # The FFN role's front end refuses generation and reports its loop.
        status = json.loads(_get(pair.ffn.url + "/health"))
        assert status["healthy"] and status["ranks"][0]["steps"] > 0
        with pytest.raises(Exception, match="400"):
            complete(pair.ffn, PROMPTS[:1])


def _get(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_two_attention_ranks_one_ffn_rank(models, colocated, logs):
    with afd_pair("dsv2-2A1F", logs, models["deepseek_v2"], num_attention_ranks=2) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        problems = compare(answers, colocated["deepseek_v2"])
        assert not problems, "\n".join(problems)
        log = pair.ffn.log_path.read_text()
        assert re.search(r"handshake with 2 peers ok", log), "FFN rank did not serve 2 ranks"


def test_negative_control_and_sigterm_on_ffn_ends_both(models, colocated, logs):
    """An FFN role with other experts gives other answers (so equality above means something);
    then SIGTERM on the FFN server ends both roles within 30 s."""
    with afd_pair("dsv2-negative", logs, models["deepseek_v2"],
                  ffn_model=models["deepseek_v2-other-experts"]) as pair:
        answers = complete(pair.attention, PROMPTS[:NUM_PROMPTS])
        differing = compare(answers, colocated["deepseek_v2"])
        assert len(differing) >= NUM_PROMPTS // 2, differing
        start = time.monotonic()
        pair.ffn.signal(signal.SIGTERM)
        assert wait_gone(pair.servers, 30), (
            f"processes left: FFN {pair.ffn.pids()}, attention {pair.attention.pids()}\n"
            f"{pair.attention.log_tail()}")
        say(f"SIGTERM on FFN: both roles gone after {time.monotonic() - start:.1f} s")


def test_sigterm_on_attention_ends_both(models, logs):
    with afd_pair("qwen3-sigterm", logs, models["qwen3_moe"]) as pair:
        complete(pair.attention, PROMPTS[:2], max_tokens=4)
        start = time.monotonic()
        pair.attention.signal(signal.SIGTERM)
        assert wait_gone(pair.servers, 30), (
            f"processes left: FFN {pair.ffn.pids()}, attention {pair.attention.pids()}\n"
            f"{pair.ffn.log_tail()}")
        say(f"SIGTERM on attention: both roles gone after {time.monotonic() - start:.1f} s")
