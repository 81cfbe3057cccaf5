"""The attention role's data path, in one process and in seconds: ``AttentionSession`` (step
begin and end, empty stages, the ride-through), ``MicroBatchPipeline`` with m = 1..3 and the
runner's split on request boundaries, against real FFN services, over ``LoopbackAFDConnector``
(the P2P connector's wire with in-process mailboxes, afd_common.transport.loopback).

Each forward is checked against the same model run with every expert local: micro-batching, the
split of the rows over the FFN ranks (replicated or sharded experts), an idle DP rank's dummy
step and stages without rows must not change a single value. The e2e tier does the same through
``vllm serve`` on real models, for fewer combinations.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from afd_attention.loopback_connector import LoopbackAttentionConnector
from afd_attention.micro_batches import MicroBatchPipeline, split_on_requests
from afd_attention.session import AttentionSession
from afd_common.vllm_glue import lifecycle
from afd_common.config import parse_afd_config
from afd_common.transport.loopback import LoopbackGroup, _Hub
from afd_common.metadata import ModelShape
from afd_common.metrics import Recorder
from afd_common.placement import placement_for
from afd_common.vllm_glue.server_root import SERVER_PID_ENV
from afd_common.registry import resolve_connector
from afd_common.tools.launch import free_port
from afd_ffn.loopback_connector import LoopbackFFNConnector
from afd_ffn.service import FFNService

CONNECTOR = "LoopbackAFDConnector"
HIDDEN, EXPERTS, TOP_K = 8, 7, 2
MOE_LAYERS = (1, 2, 3)


def expert(x: torch.Tensor, layer: int, e: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``layer`` on rows ``x`` (a different map per layer and expert)."""
    return x * (layer + 1) + e.unsqueeze(-1).to(x.dtype)


def routing(x: torch.Tensor, layer: int):
    """The gate, on the attention side: top-k ids and weights from the rows themselves."""
    base = (x[:, 0].abs() * 10).long() + layer
    ids = torch.stack([(base + k * 3) % EXPERTS for k in range(TOP_K)], dim=1).to(torch.int32)
    weights = torch.tensor([0.75, 0.25])[:TOP_K].expand(x.shape[0], TOP_K).contiguous()
    return ids, weights


def experts_of(x, layer, ids, weights, mine=None) -> torch.Tensor:
    w = weights if mine is None else weights * mine
    return sum(w[:, k:k + 1] * expert(x, layer, ids[:, k]) for k in range(ids.shape[1]))


def local_model(x: torch.Tensor, gate_on_attention: bool) -> torch.Tensor:
    """The whole model with every expert here: what AFD must reproduce exactly."""
    for layer in MOE_LAYERS:
        if gate_on_attention:
            x = x + experts_of(x, layer, *routing(x, layer))
        else:
            x = x + expert(x, layer, torch.zeros(x.shape[0]))
    return x


class Deployment:
    """A attention ranks and F FFN services of one loopback world, in this process."""

    def __init__(self, A: int, F: int, m: int, sharded: bool = False,
                 gate_on_attention: bool = True, **extra):
        self.A, self.F, self.m, self.gate = A, F, m, gate_on_attention
        self.shape = ModelShape(hidden_size=HIDDEN, dtype=torch.float32, num_layers=4,
                                moe_layers=MOE_LAYERS, num_experts=EXPERTS, top_k=TOP_K,
                                architecture="t", placement=placement_for(EXPERTS, F, sharded))
        self.afd = {"connector": CONNECTOR, "num_attention_ranks": A, "num_ffn_ranks": F,
                    "port": free_port(), "compute_gate_on_attention": gate_on_attention,
                    "connector_extra_config": {"num_micro_batches": m, "timeout_s": 10,
                                               "connect_timeout_s": 20, **extra}}
        self.ffn: list[FFNService] = []
        self.kill_at: int | None = None  # FFN rank 0 kills the FFN role at this layer, once
        self.start_ffn()
        attn = resolve_connector(CONNECTOR, "attention")
        config = self.config("attention")
        self.sessions = [AttentionSession(config, attn(config, a, self.shape), rank=a,
                                          new_connector=lambda cfg, a=a: attn(cfg, a,
                                                                               self.shape))
                         for a in range(A)]
        for s in self.sessions:
            s.start_connecting()
        for s in self.sessions:
            assert s._peers.wait(20), "the loopback world did not form"
            s.startup_done()
        self.pipelines = [MicroBatchPipeline(m) for _ in range(A)]

    def config(self, role: str):
        return parse_afd_config({"role": role, **self.afd})

    def start_ffn(self) -> None:
        config = self.config("ffn")
        owners = self.shape.placement.owner_table if self.shape.placement.sharded else None

        def compute_for(rank):
            def compute(item):
                x, layer = item.hidden_states, item.layer_idx
                if rank == 0 and layer == self.kill_at:
                    self.kill_at = None
                    threading.Thread(target=self.restart_ffn).start()
                    time.sleep(0.1)  # the services are stopped before this result goes out
                if item.topk_ids is None:  # the gate on the FFN role: here, expert 0
                    return expert(x, layer, torch.zeros(x.shape[0]))
                mine = None if owners is None else owners[item.topk_ids.long()] == rank
                return experts_of(x, layer, item.topk_ids, item.topk_weights, mine)
            return compute
        self.ffn = [FFNService(config, f, self.shape, compute_for(f), "cpu")
                    for f in range(self.F)]
        for service in self.ffn:
            service.start()

    def stop_ffn(self) -> None:
        """Stop every FFN service and wait for its thread: none may still hold a rendezvous
        when the interpreter exits (a C++ store thread destroyed then aborts the process)."""
        for service in self.ffn:
            service.stop()
        for service in self.ffn:
            service._thread.join(15)
            assert not service._thread.is_alive(), f"FFN rank {service.rank} did not stop"

    def restart_ffn(self) -> None:
        """Stop every FFN service (their connections close, as a killed role's do) and start
        new ones on the same address."""
        self.stop_ffn()
        time.sleep(0.3)
        self.start_ffn()

    def model(self, a: int, x: torch.Tensor) -> torch.Tensor:
        """Attention rank ``a``'s forward of rows ``x``: every MoE layer through the session."""
        s = self.sessions[a]
        for layer in MOE_LAYERS:
            ids, weights = routing(x, layer) if self.gate else (None, None)
            x = x + s.remote_experts(f"model.layers.{layer}.mlp.experts", x,
                                     topk_weights=weights, topk_ids=ids)
        return x

    @torch.inference_mode()  # as vLLM's runner runs its forwards
    def forward(self, a: int, x: torch.Tensor, query_lens: list[int] | None) -> torch.Tensor:
        """What the runner does with one vLLM step: split on request boundaries into at most m
        micro-batches (``query_lens`` None: a dummy batch, never split), run it again from its
        start if the FFN role is lost and comes back."""
        s = self.sessions[a]

        def run():
            if query_lens is None or self.m == 1:
                s.stage_started(0)
                return self.model(a, x)
            starts = np.concatenate([[0], np.cumsum(query_lens)])
            cuts = [t for _, t in split_on_requests(starts, self.m)]
            if len(cuts) == 1:
                s.stage_started(0)
                return self.model(a, x)
            return torch.cat(s.run_micro_batches(self.pipelines[a], cuts,
                                                 lambda cut: self.model(a, x[cut]),
                                                 lambda stage: None))
        return s.run_forward(run)

    def step(self, batches: list[list[int] | None], seed: int) -> None:
        """One step on every attention rank at once (vLLM's DP ranks step together): rank a
        runs ``batches[a]`` (query lengths; None: an idle rank's one-row dummy batch)."""
        g = torch.Generator().manual_seed(seed)
        inputs = [torch.randint(-4, 5, (sum(q) if q else 1, HIDDEN), generator=g).float()
                  for q in batches]
        out: dict = {}

        def run(a):
            try:
                out[a] = self.forward(a, inputs[a], batches[a])
            except BaseException as e:  # noqa: BLE001 - inspected below
                out[a] = e
        threads = [threading.Thread(target=run, args=(a,)) for a in range(self.A)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a step hung"
        for a in range(self.A):
            assert not isinstance(out[a], BaseException), f"attention rank {a}: {out[a]!r}"
            assert torch.equal(out[a], local_model(inputs[a], self.gate)), f"rank {a} differs"

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        self.stop_ffn()


@pytest.fixture
def deploy(monkeypatch, tmp_path):
    """Deployments closed after the test; the role's own ending recorded, not done."""
    failures: list = []
    monkeypatch.setattr(lifecycle, "mark_failed", failures.append)
    monkeypatch.setattr(lifecycle, "exit_worker", lambda: failures.append("exit"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # /health status files
    monkeypatch.setenv(SERVER_PID_ENV, "2718")
    made: list[Deployment] = []

    def make(*args, **kwargs) -> Deployment:
        made.append(Deployment(*args, **kwargs))
        made[-1].failures = failures
        return made[-1]
    yield make
    for d in made:
        d.close()


# Steps of 2 attention DP ranks: query lengths per request, None for an idle rank's dummy batch.
# Fewer requests than micro-batches leave stages empty; rank 1 idles while rank 0 works.
STEPS = [[[5, 3, 4], [2, 2]], [[7], [1, 1, 1, 1]], [[3, 1, 2, 6], None], [None, [4, 4, 1]],
         [[1, 1], [9]]]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_micro_batched_steps_of_two_dp_ranks_match_the_local_model(deploy, m):
    """2A2F with the experts sharded over the FFN ranks (M2N), gate on attention."""
    d = deploy(2, 2, m, sharded=True)
    for i, batches in enumerate(STEPS):
        d.step(batches, seed=i)
    assert all(s.step == len(STEPS) for s in d.sessions)
    end = time.monotonic() + 5  # an FFN rank counts a step after its last result went out
    while not all(service.status()["steps"] == len(STEPS) for service in d.ffn):
        assert time.monotonic() < end, [service.status() for service in d.ffn]
        time.sleep(0.01)
    assert d.failures == []


def test_replicated_experts_with_the_gate_on_the_ffn_role(deploy):
    """1A2F, every expert on both FFN ranks: each takes a share of the rows of every stage."""
    d = deploy(1, 2, 2, sharded=False, gate_on_attention=False)
    for i, batches in enumerate([[[3, 5]], [[1]], [[2, 2, 2]]]):
        d.step(batches, seed=i)
    assert d.failures == []


def test_an_error_in_one_micro_batch_fails_the_forward_with_that_error(deploy):
    """An exception in micro-batch 1's model code ends the other micro-batches (they are moot)
    and the forward raises it, not a stand-in, at once."""
    d = deploy(1, 1, 2)
    s, x = d.sessions[0], torch.ones(4, HIDDEN)

    def forward(cut):
        if cut.start:  # micro-batch 1
            raise ValueError("a kernel of micro-batch 1 failed")
        return d.model(0, x[cut])
    start = time.monotonic()
    with pytest.raises(ValueError, match="micro-batch 1 failed"):
        s.run_micro_batches(d.pipelines[0], [slice(0, 2), slice(2, 4)], forward,
                            lambda stage: None)
    assert time.monotonic() - start < 5


def test_a_restarted_ffn_role_serves_the_interrupted_forward_again(deploy, caplog):
    """The FFN role goes down in the middle of a micro-batched step (at layer 2) and a new one
    comes up: the attention ranks ride through, the interrupted forward runs again from its
    start on the new one, and every step matches the local model."""
    d = deploy(2, 2, 2, sharded=True, reconnect_timeout_s=30)
    d.step(STEPS[0], seed=0)
    d.kill_at = 2
    d.step(STEPS[1], seed=1)
    d.step(STEPS[2], seed=2)
    assert "was interrupted" in caplog.text
    assert all(s.worlds == 2 and s.step == 2 for s in d.sessions)
    assert d.failures == []


@pytest.mark.parametrize("m", [1, 2])
def test_dp_ranks_lost_a_forward_apart_line_up_on_the_next_ffn_role(deploy, monkeypatch,
                                                                     caplog, m):
    """The FFN role sends attention rank 1 its last layer's result and is lost before rank 0's:
    rank 1 finished the step, rank 0 runs it again. vLLM's DP ranks step together, so rank 1
    cannot start its next step before rank 0 finished this one; the new FFN role's first step
    must pair rank 0's re-run with an empty step of rank 1 (told in the handshake), or both
    wait for each other until a timeout. The empty step adds to the device counters that the
    forwards made, as CAMP2pAFDConnector's metrics do: it must run in inference mode as they do."""
    d = deploy(2, 1, m, reconnect_timeout_s=30)
    send_rows, rec = LoopbackAttentionConnector.send_attn_output, Recorder("attention", CONNECTOR)

    def send_counting_rows_on_the_device(self, hidden_states, *args):
        rec.routed_per_rank(torch.tensor([hidden_states.shape[0]]))
        return send_rows(self, hidden_states, *args)
    monkeypatch.setattr(LoopbackAttentionConnector, "send_attn_output",
                        send_counting_rows_on_the_device)
    send = LoopbackFFNConnector.send_ffn_output
    armed = []

    def send_rank_1_only_then_die(self, output, item):
        if not (armed and item.layer_idx == MOE_LAYERS[-1] and item.meta.stage == 0):
            return send(self, output, item)
        armed.clear()
        rows = dict(item.meta.sources)
        meta = item.meta._replace(sources=((0, 0), (1, rows[1])))
        send(self, output[rows[0]:], item._replace(meta=meta))
        threading.Thread(target=d.restart_ffn).start()
    monkeypatch.setattr(LoopbackFFNConnector, "send_ffn_output", send_rank_1_only_then_die)
    d.step(STEPS[0], seed=0)
    armed.append(True)
    caplog.set_level(logging.INFO, logger="vllm.afd")
    d.step([[3], [2]], seed=1)  # one request each: stage 0 has the rows also when m = 2
    assert "1 empty step first" in caplog.text and "was interrupted" in caplog.text
    d.step(STEPS[1], seed=2)
    assert [(s.worlds, s.step, s.forwards_done) for s in d.sessions] == [(2, 2, 3)] * 2
    assert d.failures == []


def test_loopback_waits_fail_when_the_peer_leaves_and_time_out_naming_what():
    hub = _Hub(2)
    a, b = LoopbackGroup(hub, "k", 0), LoopbackGroup(hub, "k", 1)
    got = torch.empty(3)
    pending = b.recv([got], 0, 7)
    a.send([torch.arange(3.0)], 1, 7).wait(timedelta(seconds=1))  # done: the receive is posted
    assert pending.wait(timedelta(seconds=1)) and torch.equal(got, torch.arange(3.0))
    with pytest.raises(RuntimeError, match="Timed out .* from rank 0 with tag 8"):
        b.recv([got], 0, 8).wait(timedelta(seconds=0.05))
    a.send([torch.zeros(4)], 1, 9)  # longer than the receive: refused, as Gloo does
    with pytest.raises(RuntimeError, match="size mismatch"):
        b.recv([got], 0, 9).wait(timedelta(seconds=1))
    a.send([torch.zeros(2)], 1, 9)  # shorter: lands in the first bytes, as on Gloo
    assert b.recv([got], 0, 9).wait(timedelta(seconds=1))
    assert got.tolist() == [0.0, 0.0, 2.0]
    waiting = b.recv([got], 0, 10)
    threading.Timer(0.05, a.shutdown).start()
    with pytest.raises(RuntimeError, match="Connection closed by peer: loopback rank 0 left"):
        waiting.wait(timedelta(seconds=5))


def test_a_loopback_world_split_over_two_processes_is_refused():
    from afd_common.transport.loopback import join_group

    class OtherProcessStore:  # rank 0 named mailboxes that live in another process
        def get(self, key):
            return b"made-elsewhere"
    with pytest.raises(RuntimeError, match="every rank of the AFD world in one process"):
        join_group(OtherProcessStore(), 1, 2)


@pytest.mark.parametrize("role", ["ffn", "attention"])
def test_close_ends_a_wait_for_the_peers_at_once(role):
    """A stopped FFN service or attention session closes its connector while ``init`` waits
    for the other role (the FFN role hosts the rendezvous, the attention role looks for it):
    the wait ends with a clear error at once, not at ``connect_timeout_s``."""
    from afd_common.errors import AFDPeerError

    shape = ModelShape(hidden_size=HIDDEN, dtype=torch.float32, num_layers=2, moe_layers=(1,),
                       num_experts=EXPERTS, top_k=TOP_K,
                       placement=placement_for(EXPERTS, 1, False))
    config = parse_afd_config({"role": role, "connector": CONNECTOR, "port": free_port(),
                               "connector_extra_config": {"connect_timeout_s": 60}})
    conn = resolve_connector(CONNECTOR, role)(config, 0, shape)
    out: dict = {}

    def connect():
        try:
            conn.init()
        except BaseException as e:  # noqa: BLE001 - inspected below
            out["error"] = e
    t = threading.Thread(target=connect)
    t.start()
    time.sleep(0.5)
    start = time.monotonic()
    conn.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5
    assert isinstance(out.get("error"), AFDPeerError) and "closed while waiting" in str(
        out["error"])
