"""Refuse mismatches, bound every wait, lose no request: with real `vllm serve` roles."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from afd_common.tools.launch import Server, afd_args, wait_gone
from afd_common.vllm_glue.lifecycle import FAILED_EXIT_CODE
from afd_common.tools.launch import free_port
from afd_common.tools.tiny_model import write_tiny_model

from .conftest import AUTH_SECRET as SECRET
from .conftest import Pair, get, kill_all, long_request, run_mixed, say

pytestmark = pytest.mark.e2e


def wait_for_line(server: Server, needle: str, timeout_s: float = 240, after: int = 0) -> float:
    """When ``needle`` appears in the server's log (past its first ``after`` characters)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if needle in server.log_path.read_text(errors="replace")[after:]:
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


WRONG = "other-afd-token-0043"
RECONNECT_S = 10
# Every role of this module: the load pair's bounds (a step's wait, the ride-through).
SERVICE_CONFIG = {"timeout_s": 15, "reconnect_timeout_s": RECONNECT_S}
THIRD_PARTY = Path(__file__).parent / "third_party"
WAITS_AGAIN = "waiting for the next attention role"


@dataclass
class Service:
    """One FFN role for the whole module, the service it is in production: it refuses each
    attention role that does not belong (another shape, connector, rank count or token), waits
    for the next after each, then serves the one that belongs (the load tests, last)."""

    ffn: Server
    port: int  # the AFD rendezvous
    logs: Path
    # The attention roles it meets: name -> (checkpoint, env, AFD config overrides); the right
    # token unless env says otherwise.
    roles: dict[str, tuple[Path, dict, dict]]
    started: list[Server] = field(default_factory=list)  # stopped with the FFN role

    def attention(self, name: str) -> Server:
        """Start the attention role ``name``."""
        model, env, afd = self.roles[name]
        self.started.append(Server(
            f"{name}-attention", str(model), free_port(), self.logs / f"{name}-attention.log",
            args=afd_args("attention", self.port, connector_extra_config=SERVICE_CONFIG, **afd),
            cores="0", env={"AFD_AUTH_TOKEN": SECRET, **env}).start())
        return self.started[-1]

    def ffn_log(self) -> str:
        return self.ffn.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def service(models, other_models, logs):
    port = free_port()
    ffn = Server("service-ffn", str(models["deepseek_v2"]), free_port(), logs / "service-ffn.log",
                 args=afd_args("ffn", port, connector_extra_config=SERVICE_CONFIG), cores="1",
                 env={"AFD_AUTH_TOKEN": SECRET}).start()
    # Serving before the first attention role starts: each role's bound below measures its
    # refusal and its exit, not the FFN role's start-up (16 s of a CI run's 20.7 s).
    ffn.wait_ready(progress=say)
    model = models["deepseek_v2"]
    # Another connector, installed the way a third party ships one (an entry point).
    third_party = {"PYTHONPATH": os.pathsep.join(
        p for p in (str(THIRD_PARTY), os.environ.get("PYTHONPATH")) if p)}
    roles = {"mismatch-num_layers": (other_models["num_layers"], {}, {}),
             "mismatch-connector": (model, third_party, {"connector": "OtherConnector"}),
             "mismatch-num_ffn_ranks": (model, {}, {"num_ffn_ranks": 2}),
             "auth-wrong": (model, {"AFD_AUTH_TOKEN": WRONG}, {}),
             "load": (model, {}, {})}
    service = Service(ffn, port, logs, roles)
    try:
        yield service
    finally:
        for server in (*service.started, ffn):
            server.stop(5)


def refused(service: Service, name: str) -> tuple[str, str]:
    """The attention role ``name`` reaches the handshake, is refused and stops (non-zero)
    within 30 s; the FFN role, the same process, waits for the next. Returns both roles' logs
    of it."""
    attention = service.attention(name)
    ffn_before = service.ffn_log()
    try:
        reached = wait_for_line(attention, "connecting to the FFN role")
        gone = wait_gone([attention], 30)
        say(f"{attention.name}: stopped {time.monotonic() - reached:.1f} s after it reached "
            f"the handshake (exit code {attention.proc.returncode}); the FFN role waits for "
            "another")
        assert gone, f"still running: attention {attention.pids()}\n{attention.log_tail()}"
    finally:
        attention.stop(5)
    assert attention.proc.returncode != 0
    wait_for_line(service.ffn, WAITS_AGAIN, 30, after=len(ffn_before))
    return service.ffn_log()[len(ffn_before):], attention.log_path.read_text(errors="replace")


# (what differs on the attention side, the field the error must name). Only what needs vLLM to
# show: a shape vLLM derives from the checkpoint, a third-party connector found by its entry
# point, and the FFN rank count; every other fingerprint field (hidden size, micro-batches,
# dtype, placement) is refused the same way in tests/test_handshake.py.
MISMATCHES = [
    ("num_layers", "num_layers"),
    ("connector", "connector"),
    ("num_ffn_ranks", "num_ffn_ranks"),
]


@pytest.mark.parametrize("change,field", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatched_roles_are_refused_naming_the_field(change, field, service):
    for log in refused(service, f"mismatch-{change}"):
        assert f"'{field}' differs" in log, log[-4000:]


def test_auth_token_wrong_is_refused_and_never_logged(service):
    ffn_log, attention_log = refused(service, "auth-wrong")
    assert "authentication failed" in attention_log
    for text in (ffn_log, attention_log):
        assert SECRET not in text and WRONG not in text


@pytest.fixture(scope="module")
def load_pair(service):
    """The attention role that belongs, with the right token: the FFN role serves it."""
    attention = service.attention("load")
    attention.wait_ready(progress=say, others=(service.ffn,))
    return Pair([service.ffn], [attention], service.port)


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
    for server in pair.servers:  # the right token was never logged either
        assert SECRET not in server.log_path.read_text(errors="replace")
