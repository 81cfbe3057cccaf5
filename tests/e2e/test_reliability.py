"""Refuse mismatches, bound every wait, lose no request: with real `vllm serve` roles."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from pathlib import Path

import pytest

from afd_common.tools.launch import Server, afd_args, wait_gone
from afd_common.vllm_glue.lifecycle import FAILED_EXIT_CODE
from afd_common.tools.launch import free_port
from afd_common.tools.tiny_model import write_tiny_model

from .conftest import AUTH_SECRET as SECRET
from .conftest import afd_pair, get, kill_all, long_request, run_mixed, say

pytestmark = pytest.mark.e2e


def wait_for_line(server: Server, needle: str, timeout_s: float = 240) -> float:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if needle in server.log_path.read_text(errors="replace"):
            return time.monotonic()
        if server.exited():
            raise AssertionError(f"{server.name} exited before {needle!r}:\n{server.log_tail()}")
        time.sleep(0.2)
    raise AssertionError(f"{server.name}: no {needle!r} within {timeout_s} s:\n"
                         f"{server.log_tail()}")


@pytest.fixture(scope="module")
def other_models(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("mismatch")
    return {"num_layers": write_tiny_model("deepseek_v2", root / "layers", num_layers=3)}


# (what differs on the FFN side, the field the error must name). Only what needs vLLM to show:
# a shape vLLM derives from the checkpoint, a third-party connector found by its entry point,
# and a rank count from --data-parallel-size; every other fingerprint field (hidden size,
# micro-batches, dtype, placement) is refused the same way in tests/test_handshake.py.
MISMATCHES = [
    ("num_layers", "num_layers"),
    ("connector", "connector"),
    ("num_ffn_ranks", "num_ffn_ranks"),
]
THIRD_PARTY = Path(__file__).parent / "third_party"


@pytest.mark.parametrize("change,field", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatched_roles_are_refused_naming_the_field(change, field, models, other_models,
                                                       logs):
    port = free_port()
    attn_model = ffn_model = models["deepseek_v2"]
    ffn_afd: dict = {}
    ffn_env: dict = {}
    if change in other_models:
        ffn_model = other_models[change]
    elif change == "connector":
        # Another connector, installed the way a third party ships one (an entry point).
        ffn_afd = {"connector": "OtherConnector"}
        ffn_env = {"PYTHONPATH": os.pathsep.join(
            p for p in (str(THIRD_PARTY), os.environ.get("PYTHONPATH")) if p)}
    elif change == "num_ffn_ranks":
        ffn_afd = {"num_ffn_ranks": 2}
    ffn_args = afd_args("ffn", port, **ffn_afd)
    if change == "num_ffn_ranks":
        ffn_args += ["--data-parallel-size", "2"]
    ffn = Server(f"mismatch-{change}-ffn", str(ffn_model), free_port(),
                 logs / f"mismatch-{change}-ffn.log", args=ffn_args, env=ffn_env,
                 cores="1|0" if change == "num_ffn_ranks" else "1").start()
    attention = Server(f"mismatch-{change}-attention", str(attn_model), free_port(),
                       logs / f"mismatch-{change}-attention.log",
                       args=afd_args("attention", port), cores="0").start()
    try:
        later = max(wait_for_line(ffn, "waiting for the attention role"),
                    wait_for_line(attention, "connecting to the FFN role"))
        gone = wait_gone([attention], max(0.0, later + 30 - time.monotonic()))
        say(f"mismatch {change}: the attention role stopped {time.monotonic() - later:.1f} s "
            f"after the later role reached the handshake (exit code "
            f"{attention.proc.returncode}); the FFN role waits for another")
        assert gone, f"still running: attention {attention.pids()}"
        assert attention.proc.returncode != 0
        # The FFN role refused that attention role and stays up for one that belongs.
        wait_for_line(ffn, "waiting for the next attention role", 30)
        assert not ffn.exited()
        for server in (ffn, attention):
            log = server.log_path.read_text(errors="replace")
            assert f"'{field}' differs" in log, f"{server.name}:\n{server.log_tail(40)}"
    finally:
        ffn.stop(5), attention.stop(5)


WRONG = "other-afd-token-0043"
TIMEOUT = {"timeout_s": 15}


def test_auth_token_wrong_is_refused_and_never_logged(models, logs):
    port = free_port()
    ffn = Server("auth-ffn", str(models["qwen3_moe"]), free_port(), logs / "auth-ffn.log",
                 args=afd_args("ffn", port), cores="1", env={"AFD_AUTH_TOKEN": SECRET}).start()
    attention = Server("auth-attention", str(models["qwen3_moe"]), free_port(),
                       logs / "auth-attention.log", args=afd_args("attention", port), cores="0",
                       env={"AFD_AUTH_TOKEN": WRONG}).start()
    try:
        assert wait_gone([attention], 240), attention.log_tail()
        assert "authentication failed" in attention.log_path.read_text(errors="replace")
    finally:
        ffn.stop(5), attention.stop(5)
    for server in (ffn, attention):
        text = server.log_path.read_text(errors="replace")
        assert SECRET not in text and WRONG not in text


RECONNECT_S = 10


@pytest.fixture(scope="module")
def load_pair(models, logs):
    with afd_pair("load", logs, models["deepseek_v2"],
                  connector_extra_config={**TIMEOUT, "reconnect_timeout_s": RECONNECT_S}) as pair:
        yield pair


def test_64_concurrent_mixed_requests_exact(load_pair, colocated):
    answers = run_mixed(load_pair.attention)
    assert len(answers) == 64
    mismatched = [i for i, (a, b) in enumerate(zip(answers, colocated["deepseek_v2-mixed"]))
                  if a != b]
    assert not mismatched, f"requests {mismatched} differ from colocated"


def test_an_ffn_role_gone_past_reconnect_timeout_fails_requests_and_ends_the_attention_role(
        load_pair):
    """SIGKILL the FFN role mid-generation and start none: the attention role waits
    ``reconnect_timeout_s`` (10 s), answering /health with 503 and why, then fails the request
    with an error and exits 3; no process of either role is left."""
    pair = load_pair
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(long_request, pair.attention)
        time.sleep(1.5)
        assert not fut.done(), "generation finished before the kill; make it longer"
        killed = time.monotonic()
        kill_all(pair.ffn)
        while pair.attention.health() != 503 and time.monotonic() < killed + RECONNECT_S:
            time.sleep(0.2)
        waiting = json.loads(get(pair.attention.url + "/health", ok_only=False))
        status, detail = fut.result(timeout=RECONNECT_S + 30)
        took = time.monotonic() - killed
    say(f"SIGKILL FFN, none started: /health said {waiting}; the in-flight request ended with "
        f"{status} after {took:.1f} s (reconnect_timeout_s {RECONNECT_S})")
    assert waiting["afd_role"] == "attention" and not waiting["healthy"]
    assert "attention rank 0" in waiting["ranks"][0]["reason"]
    assert status != 200 and RECONNECT_S <= took <= RECONNECT_S + 20, (status, detail)
    assert wait_gone([pair.ffn], 30)
    assert wait_gone([pair.attention], 30), "the attention role should stop by itself"
    assert pair.attention.proc.returncode == FAILED_EXIT_CODE
    log = pair.attention.log_path.read_text(errors="replace")
    assert f"no FFN role came back within reconnect_timeout_s ({RECONNECT_S} s)" in log
