"""The attention role starts without its FFN role: vLLM's start-up forwards never touch the
connector, and the first step after start-up waits for the connection (or its failure).

Driven through ``AttentionSession`` with a recording connector, no vLLM server; the e2e tier
starts the roles in both orders a minute apart (tests/e2e/test_vllm_afd.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd_attention.session import AttentionSession
from afd_common.config import parse_afd_config
from afd_common.contract import PendingResult
from afd_common.errors import AFDPeerError
from afd_common.metadata import ModelShape
from afd_common.placement import placement_for

LAYERS = (1, 2)


class Recording:
    """An attention connector that answers each layer with its input doubled."""

    def __init__(self):
        self.shape = ModelShape(hidden_size=4, dtype=torch.float32, num_layers=3,
                                moe_layers=LAYERS, num_experts=4, top_k=1, architecture="t",
                                placement=placement_for(4, 1, False))
        self.calls: list[tuple] = []
        self._out: dict = {}

    def begin_step(self, meta):
        self.calls.append(("step", meta.step, meta.stage_tokens))

    def send_attn_output(self, x, call, topk_ids=None, topk_weights=None):
        self.calls.append(("send", call.layer_idx, call.stage, x.shape[0]))
        self._out[call] = x * 2
        return PendingResult(call)

    def recv_ffn_output(self, pending):
        return self._out.pop(pending.call)

    def end_step(self):
        self.calls.append(("end",))

    def close(self):
        pass


def session() -> tuple[AttentionSession, Recording]:
    config = parse_afd_config({"role": "attention", "connector_extra_config": {}},
                              resolve_connector=False)
    conn = Recording()
    return AttentionSession(config, conn), conn


def forward(s: AttentionSession, rows: int = 3) -> list[torch.Tensor]:
    x = torch.ones(rows, 4)
    return [s.remote_experts(f"model.layers.{layer}.mlp.experts", x, None, None)
            for layer in LAYERS]


def test_start_up_forwards_run_without_the_connector_and_give_zeros():
    s, conn = session()
    outs = forward(s)  # not connected, not started: a profile or warm-up run
    assert all(torch.equal(o, torch.zeros(3, 4)) for o in outs)
    assert conn.calls == [] and s.step == 0


def test_the_first_step_after_start_up_waits_for_the_connection():
    s, conn = session()
    forward(s)
    s.startup_done()
    done = threading.Event()
    result: list = []
    t = threading.Thread(target=lambda: (result.append(forward(s)), done.set()))
    t.start()
    assert not done.wait(0.5), "a step ran before the FFN role connected"
    assert conn.calls == []
    s.connected()
    assert done.wait(5)
    t.join()
    assert all(torch.equal(o, torch.full((3, 4), 2.0)) for o in result[0])
    # The FFN side's first step is this one: step 0, every layer, then the end.
    assert conn.calls == [("step", 0, (3,)), ("send", 1, 0, 3), ("send", 2, 0, 3), ("end",)]
    forward(s)  # later steps do not wait
    assert conn.calls[-4][:2] == ("step", 1)


def test_a_failed_connection_fails_the_waiting_step_the_start_up_or_asks_to_end_the_worker():
    s, conn = session()
    s.startup_done()
    errors: list = []

    def step():
        try:
            forward(s)
        except AFDPeerError as e:
            errors.append(str(e))

    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.3)
    # A step is waiting: it raises by itself, so the caller must not end the worker.
    assert s.peer_lost("could not connect: refused") == "in_step"
    t.join(5)
    assert errors == ["could not connect: refused"] and conn.calls == []
    starting, _ = session()  # vLLM still starting: its start-up fails at the end, by itself
    assert starting.peer_lost("refused: 'num_layers' differs") == "starting"
    with pytest.raises(AFDPeerError, match="num_layers"):
        starting.startup_done()
    idle, _ = session()
    idle.startup_done()
    assert idle.peer_lost("gone") == "idle"  # nothing would raise: the caller ends the worker
    with pytest.raises(AFDPeerError, match="gone"):
        forward(idle)


@pytest.mark.parametrize("backend,bound,warned", [("mp", 300, True), ("mp", 240, False),
                                                  ("uni", 600, False)])
def test_a_ride_through_bound_vllm_would_cut_short_is_warned_about(backend, bound, warned,
                                                                   monkeypatch):
    """vLLM's multiprocess executor (DP or TP attention) ends a forward after
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s here), whatever reconnect_timeout_s says."""
    import logging
    from types import SimpleNamespace

    from afd_attention.model_runner import warn_if_vllm_ends_the_ride_through_first

    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300")
    config = parse_afd_config({"role": "attention", "port": 1, "connector_extra_config":
                               {"reconnect_timeout_s": bound}})
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        distributed_executor_backend=backend))
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("vllm.afd")
    logger.addHandler(handler)
    try:
        warn_if_vllm_ends_the_ride_through_first(config, vllm_config)
    finally:
        logger.removeHandler(handler)
    assert any("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s)" in m and f"({bound:g} s)" in m
               for m in seen) == warned, seen
