"""The attention role rides through the loss of its FFN role: the interrupted forward runs again
from its start on the next FFN world, ``/health``'s status says why it waits meanwhile, and past
``reconnect_timeout_s`` (or with it 0) the role fails as before.

Driven through ``AttentionSession`` with in-process connectors whose FFN role can be killed and
brought back, no vLLM server; the e2e tier kills and restarts real FFN servers under load
(tests/e2e/test_vllm_afd.py)."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import torch

from afd_attention import session as session_mod
from afd_attention.micro_batches import MicroBatchPipeline
from afd_attention.session import AttentionSession
from afd_common.vllm_glue import lifecycle, role_status
from afd_common.config import parse_afd_config
from afd_common.contract import PendingResult
from afd_common.errors import AFDPeerError, AFDRendezvousClosingError, AFDTimeoutError
from afd_common.metadata import ModelShape
from afd_common.placement import placement_for
from afd_common.vllm_glue.server_root import SERVER_PID_ENV

LAYERS = (1, 2, 3)
SHAPE = ModelShape(hidden_size=4, dtype=torch.float32, num_layers=4, moe_layers=LAYERS,
                   num_experts=4, top_k=1, architecture="t", placement=placement_for(4, 1, False))


class FFNRole:
    """Where the connectors find an FFN role: up (an Event) or not; it may die at a layer."""

    def __init__(self):
        self.up = threading.Event()
        self.die_at: tuple[int, int] | None = None  # (world, layer): the receive fails there
        self.restart_s: float | None = None  # then it is back after this long
        self.closing = 0  # connects that find the lost world's rendezvous still closing
        self.worlds: list[World] = []

    def die(self) -> None:
        self.up.clear()
        if self.restart_s is not None:
            threading.Timer(self.restart_s, self.up.set).start()


class World:
    """An attention connector of one FFN world: each layer comes back as ``x * (layer + 1)``."""

    def __init__(self, ffn: FFNRole, config):
        self.ffn, self.config, self.shape = ffn, config, SHAPE
        self.calls: list[tuple] = []
        self.closed = False
        self.on_lost = None
        self._out: dict = {}

    def init(self):
        limit = self.config.extra.connect_timeout_s
        if not self.ffn.up.wait(limit):
            raise AFDTimeoutError(f"no FFN role within {limit:.1f} s")
        if self.closed:
            raise AFDPeerError("closed while connecting")
        if self.ffn.closing:
            self.ffn.closing -= 1
            raise AFDRendezvousClosingError("the rendezvous is still the last world's")
        self.index = len(self.ffn.worlds)
        self.ffn.worlds.append(self)

    def watch_peers(self, on_lost):
        self.on_lost = on_lost

    def begin_step(self, meta):
        self.calls.append(("step", meta.step, meta.stage_tokens))

    def send_attn_output(self, x, call, topk_ids=None, topk_weights=None):
        self.calls.append(("send", call.layer_idx, call.stage, x.shape[0]))
        self._out[call] = x * (call.layer_idx + 1)
        return PendingResult(call)

    def recv_ffn_output(self, pending):
        call = pending.call
        if self.ffn.die_at == (self.index, call.layer_idx):
            self.ffn.die_at = None
            self.ffn.die()
            raise AFDPeerError(f"layer {call.layer_idx}: connection closed by peer")
        return self._out.pop(call)

    def end_step(self):
        self.calls.append(("end",))

    def close(self):
        self.closed = True


@pytest.fixture
def failures(monkeypatch, tmp_path):
    """What the role would do to end itself, recorded instead; status files under tmp_path."""
    record: list = []
    monkeypatch.setattr(lifecycle, "mark_failed", lambda reason: record.append(reason))
    monkeypatch.setattr(lifecycle, "exit_worker", lambda: record.append("exit"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(SERVER_PID_ENV, "4242")
    monkeypatch.setattr(session_mod, "RETRY_PAUSE_S", 0.05)
    return record


def start(ffn: FFNRole, reconnect_timeout_s: float = 30, m: int = 1) -> AttentionSession:
    config = parse_afd_config({"role": "attention", "connector_extra_config": {
        "reconnect_timeout_s": reconnect_timeout_s, "num_micro_batches": m}},
        resolve_connector=False)
    s = AttentionSession(config, World(ffn, config), rank=0,
                         new_connector=lambda cfg: World(ffn, cfg))
    s.start_connecting()
    s.startup_done()
    return s


def layers(s: AttentionSession, x: torch.Tensor) -> torch.Tensor:
    """A model forward: every MoE layer in turn, each adding its experts' output."""
    for layer in LAYERS:
        x = x + s.remote_experts(f"model.layers.{layer}.mlp.experts", x, None, None)
    return x


def expected(x: torch.Tensor) -> torch.Tensor:
    for layer in LAYERS:
        x = x + x * (layer + 1)
    return x


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_step_interrupted_by_a_lost_ffn_role_runs_again_on_the_next(failures):
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn)
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(s.run_forward(lambda: layers(s, x)), expected(x))  # world 0, step 0
    ffn.die_at = (0, 2)  # world 0 dies in step 1, at layer 2
    t, out = in_thread(lambda: s.run_forward(lambda: layers(s, x)))
    wait_until(lambda: role_status.read("attention"))
    status = role_status.read("attention")[0]
    assert status["rank"] == 0 and "connection closed by peer" in status["reason"]
    assert status["reconnect_timeout_s"] == 30
    time.sleep(0.2)
    assert t.is_alive(), "the interrupted step must wait for an FFN role"
    assert ffn.worlds[0].closed  # the lost world is closed once no step uses it
    ffn.up.set()  # a restarted FFN role
    t.join(5)
    assert "error" not in out, out
    assert torch.equal(out["value"], expected(x))  # the uninterrupted forward's result
    new = ffn.worlds[1]
    # The next world's first step is the whole interrupted forward, from its first layer.
    assert new.calls == [("step", 0, (3,)), ("send", 1, 0, 3), ("send", 2, 0, 3),
                         ("send", 3, 0, 3), ("end",)]
    assert role_status.read("attention") == [] and failures == [] and s.worlds == 2


def test_a_loss_while_idle_is_ridden_through_before_the_next_step(failures):
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn)
    x = torch.ones(2, 4)
    s.run_forward(lambda: layers(s, x))
    old = ffn.worlds[0]
    ffn.up.clear()
    old.on_lost("peer closed the connection")  # the watch notices; no step is running
    wait_until(lambda: old.closed)
    t, out = in_thread(lambda: s.run_forward(lambda: layers(s, x)))
    time.sleep(0.2)
    assert t.is_alive() and old.calls[-1] == ("end",)  # nothing went to the lost world
    ffn.up.set()
    t.join(5)
    assert torch.equal(out["value"], expected(x))
    old.on_lost("late notice from the closed world")  # ignored: that world is left behind
    assert s.run_forward(lambda: layers(s, x)) is not None
    assert failures == [] and len(ffn.worlds) == 2


def test_the_lost_world_s_rendezvous_still_closing_is_tried_again(failures):
    """A SIGTERMed FFN role's store outlives it by a moment: reaching it is no reason to end."""
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn)
    x = torch.ones(2, 4)
    s.run_forward(lambda: layers(s, x))
    ffn.closing = 2
    ffn.worlds[0].on_lost("peer closed the connection")
    assert torch.equal(s.run_forward(lambda: layers(s, x)), expected(x))
    assert ffn.closing == 0 and len(ffn.worlds) == 2 and failures == []


def test_no_ffn_role_within_reconnect_timeout_fails_the_step_and_the_role(failures):
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn, reconnect_timeout_s=0.5)
    x = torch.ones(2, 4)
    s.run_forward(lambda: layers(s, x))
    ffn.die_at = (0, 1)
    begun = time.monotonic()
    with pytest.raises(AFDPeerError, match=r"within reconnect_timeout_s \(0.5 s\)"):
        s.run_forward(lambda: layers(s, x))
    assert 0.4 < time.monotonic() - begun < 5
    # Reported (lifecycle.mark_failed logs once), and not ended from outside: the step raised.
    assert failures and all("no FFN role came back" in f for f in failures)
    assert "exit" not in failures
    assert role_status.read("attention") == []


def test_an_idle_role_past_reconnect_timeout_is_ended_from_outside(failures):
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn, reconnect_timeout_s=0.3)
    s.run_forward(lambda: layers(s, torch.ones(1, 4)))
    ffn.up.clear()
    ffn.worlds[0].on_lost("gone")
    wait_until(lambda: "exit" in failures)
    assert "reconnect_timeout_s" in failures[0]


def test_reconnect_timeout_zero_keeps_failing_fast(failures):
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn, reconnect_timeout_s=0)
    s.run_forward(lambda: layers(s, torch.ones(1, 4)))
    ffn.die_at = (0, 3)
    with pytest.raises(AFDPeerError, match="connection closed by peer"):
        s.run_forward(lambda: layers(s, torch.ones(1, 4)))
    assert len(failures) == 1 and len(ffn.worlds) == 1 and role_status.read("attention") == []


def test_a_split_step_interrupted_in_its_second_micro_batch_runs_again_whole(failures):
    ffn = FFNRole()
    ffn.up.set()
    s = start(ffn, m=2)
    pipeline = MicroBatchPipeline(2)
    x = torch.arange(20.0).reshape(5, 4)
    cuts = [slice(0, 2), slice(2, 5)]

    def split_forward():
        s.plan((2, 3))
        outs = pipeline.run([lambda c=c: layers(s, x[c]) for c in cuts], lambda stage: None)
        return torch.cat(outs)

    assert torch.equal(s.run_forward(split_forward), expected(x))

    class DieInStage1(World):
        def recv_ffn_output(self, pending):
            if (pending.call.layer_idx, pending.call.stage, self.index) == (2, 1, 1):
                self.ffn.up.clear()
                raise AFDPeerError("stage 1: connection reset")
            return super().recv_ffn_output(pending)

    ffn.up.clear()
    s._new_connector = lambda cfg: DieInStage1(ffn, cfg)
    ffn.worlds[0].on_lost("gone")
    wait_until(lambda: ffn.worlds[0].closed)
    t, out = in_thread(lambda: s.run_forward(split_forward))
    time.sleep(0.1)
    ffn.up.set()  # world 1: dies in stage 1 of layer 2
    wait_until(lambda: len(ffn.worlds) == 2 and ffn.worlds[1].closed)
    ffn.up.set()  # world 2
    t.join(5)
    assert "error" not in out, out
    assert torch.equal(out["value"], expected(x))
    assert ffn.worlds[2].calls[0] == ("step", 0, (2, 3)) and ffn.worlds[2].calls[-1] == ("end",)
    assert failures == []


def test_a_forward_interrupted_too_often_fails(failures):
    ffn = FFNRole()
    ffn.up.set()

    class AlwaysDies(World):
        def recv_ffn_output(self, pending):
            self.ffn.die()  # it restarts, and this step kills it again
            raise AFDPeerError("killed by this step")

    s = start(ffn)
    s.run_forward(lambda: layers(s, torch.ones(1, 4)))
    s._new_connector = lambda cfg: AlwaysDies(ffn, cfg)
    ffn.die_at, ffn.restart_s = (0, 1), 0.05
    with pytest.raises(AFDPeerError, match=f"interrupted {session_mod.MAX_RUNS_PER_FORWARD} "
                                           "times"):
        s.run_forward(lambda: layers(s, torch.ones(1, 4)))
    assert any("interrupted" in f for f in failures)


def test_an_interrupted_dummy_batch_runs_only_its_model_call_again(failures):
    """An idle DP rank's dummy batch first agrees on the batch with the other DP ranks (a
    collective the ranks running real steps make once per step), then calls the model: only the
    model call may run again, or this rank waits in a collective nobody else joins (the e2e
    CAMP2p 2A2F restart under load hung so)."""
    from afd_attention.model_runner import AFDAttentionRunnerMixin

    class VLLMRunner:  # what the mixin wraps
        def __init__(self, model):
            self.model, self.agreed = model, 0

        def _dummy_run(self, x):
            self.agreed += 1  # vLLM: _determine_batch_execution_and_padding, across DP
            return self.model(x)

    class Runner(AFDAttentionRunnerMixin, VLLMRunner):
        pass

    ffn = FFNRole()
    ffn.up.set()
    ffn.restart_s = 0.2
    s = start(ffn)
    model = lambda x: layers(s, x)  # noqa: E731
    runner = Runner(model)
    runner.afd_session = s
    x = torch.ones(2, 4)
    ffn.die_at = (0, 3)
    assert torch.equal(runner._dummy_run(x), expected(x))
    assert runner.agreed == 1 and runner.model is model
    assert [c for c in ffn.worlds[1].calls if c[0] == "step"] == [("step", 0, (2,))]
    assert failures == []
