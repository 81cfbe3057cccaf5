"""The sync connectors (P2P, CAMP2p) between spawned ranks over Gloo on 127.0.0.1.

CAMP2p moves its rows through the portable afd_ascend.a2e/e2a kernels over Gloo."""

import functools

import pytest
import torch

from afd_common.config import parse_afd_config
from afd_common.errors import AFDConfigError
from afd_common.metadata import LayerCall, ModelShape, StepKind, StepMetadata
from afd_common.registry import resolve_connector
from afd_common.tools.selftest import Spec, run_world
from op_world import ffn_rank_dying_at

pytestmark = pytest.mark.multiproc

TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)]


def assert_all_ok(results, spec):
    msgs = [f"{r.role} {r.rank}: {r.status} {r.detail}" for r in results if r.status != "ok"]
    assert not msgs, "\n".join(msgs)
    checked = sum(r.detail["rows_checked"] for r in results if r.role == "attention")
    served = sum(r.detail["rows"] for r in results if r.role == "ffn")
    # Every row went out once and came back once; with A < F rows are split, never duplicated.
    assert checked == served > 0
    assert all(r.detail["steps"] == spec.steps for r in results if r.role == "ffn")


@pytest.mark.parametrize("A,F", TOPOLOGIES, ids=[f"{a}A{f}F" for a, f in TOPOLOGIES])
def test_topologies_exact(A, F):
    spec = Spec(A, F, steps=4, num_layers=4, stages=2, timeout_s=30)
    assert_all_ok(run_world(spec), spec)


@pytest.mark.parametrize("A,F", [(2, 1), (2, 3)], ids=["2A1F", "2A3F"])
def test_gate_on_attention_routing_travels_with_hidden(A, F):
    spec = Spec(A, F, steps=3, gate_on_attention=True, dtype="bfloat16", timeout_s=30)
    assert_all_ok(run_world(spec), spec)


SHARDED = [("P2pAFDConnector", 1, 3, 8), ("P2pAFDConnector", 3, 2, 5),
           ("CAMP2pAFDConnector", 2, 3, 8)]  # and 2A3F P2P, 1A2F CAMP2p under in-order below


@pytest.mark.parametrize("connector,A,F,E", SHARDED,
                         ids=[f"{c}-{a}A{f}F-{e}experts" for c, a, f, e in SHARDED])
def test_sharded_experts_m2n_exact(connector, A, F, E):
    """Each row goes only to the FFN ranks owning one of its top-k experts (uneven shares when F
    does not divide E); each returns its experts' part and the attention side adds them."""
    spec = Spec(A, F, connector=connector, steps=3, num_layers=3, stages=2,
                gate_on_attention=True, num_experts=E, sharded=True, timeout_s=30)
    assert_sharded_ok(run_world(spec), spec)


def assert_sharded_ok(results, spec):
    msgs = [f"{r.role} {r.rank}: {r.status} {r.detail}" for r in results if r.status != "ok"]
    assert not msgs, "\n".join(msgs)
    checked = sum(r.detail["rows_checked"] for r in results if r.role == "attention")
    served = sum(r.detail["rows"] for r in results if r.role == "ffn")
    # A row reaches between 1 and min(top_k, F) FFN ranks; somewhere at least one reached two.
    assert checked < served <= checked * min(spec.top_k, spec.num_ffn_ranks)


INORDER = [("P2pAFDConnector", 2, 2, False, False), ("P2pAFDConnector", 1, 2, True, False),
           ("P2pAFDConnector", 2, 3, True, True), ("CAMP2pAFDConnector", 3, 2, True, False),
           ("CAMP2pAFDConnector", 1, 2, True, True)]


@pytest.mark.inorder
@pytest.mark.parametrize("connector,A,F,gate,sharded", INORDER, ids=[
    f"{c}-{a}A{f}F-gate_on_{'attention' if g else 'ffn'}{'-sharded' if s else ''}"
    for c, a, f, g, s in INORDER])
def test_orderings_are_safe_under_inorder_matching(monkeypatch, connector, A, F, gate, sharded):
    """Every rank's data plane runs in posting order, tags ignored (NCCL/HCCL matching): the
    connectors' orderings must still complete, with 2 micro-batch stages and both A:F."""
    monkeypatch.setenv("AFD_TEST_INORDER", "1")
    spec = Spec(A, F, connector=connector, steps=3, num_layers=3, stages=2,
                gate_on_attention=gate, num_experts=7, sharded=sharded, timeout_s=20)
    results = run_world(spec)
    if sharded:
        assert_sharded_ok(results, spec)
    else:
        assert_all_ok(results, spec)


def test_nccl_alias_and_one_stage():
    spec = Spec(1, 1, connector="P2pNcclAFDConnector", steps=2, stages=1, timeout_s=30)
    assert_all_ok(run_world(spec), spec)


CAM_TOPOLOGIES = [(1, 1), (2, 1), (3, 2)]


@pytest.mark.parametrize("A,F", CAM_TOPOLOGIES, ids=[f"{a}A{f}F" for a, f in CAM_TOPOLOGIES])
def test_cam_p2p_topologies_exact(A, F):
    spec = Spec(A, F, connector="CAMP2pAFDConnector", steps=4, num_layers=4, stages=2,
                timeout_s=30)
    assert_all_ok(run_world(spec), spec)


def test_cam_p2p_gate_on_attention_bf16():
    spec = Spec(2, 1, connector="CAMP2pAFDConnector", steps=3, gate_on_attention=True,
                dtype="bfloat16", timeout_s=30)
    assert_all_ok(run_world(spec), spec)


def test_cam_p2p_refuses_fewer_attention_than_ffn_ranks_before_any_socket():
    cfg = parse_afd_config({"role": "attention", "connector": "CAMP2pAFDConnector", "port": 1,
                            "num_attention_ranks": 1, "num_ffn_ranks": 2})
    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=1, moe_layers=(0,))
    with pytest.raises(ValueError, match="'num_ffn_ranks' = 2.*a % F"):
        resolve_connector("CAMP2pAFDConnector", "attention")(cfg, 0, shape)


@pytest.mark.parametrize("connector", ["P2pAFDConnector", "CAMP2pAFDConnector"])
def test_peer_killed_mid_step_fails_fast(connector):
    timeout = 8.0
    spec = Spec(2, 1, connector=connector, steps=5, timeout_s=timeout)
    results = run_world(spec, deadline_s=60, rank_fns={
        ("ffn", 0): functools.partial(ffn_rank_dying_at, die_at=(2, 1))})
    by = {(r.role, r.rank): r for r in results}
    assert by[("ffn", 0)].status == "exit" and by[("ffn", 0)].detail == 17
    for a in range(2):
        r = by[("attention", a)]
        assert r.status == "error", r
        assert "FFN rank 0" in r.detail and ("AFDPeerError" in r.detail
                                             or "AFDTimeoutError" in r.detail), r.detail
        # Measured from the moment the parent saw the FFN process gone.
        assert r.seconds - by[("ffn", 0)].seconds < timeout + 2, (r.seconds,
                                                                  by[("ffn", 0)].seconds)
    # Not the whole test's time: that is mostly three ranks importing torch, which a loaded
    # machine stretches (31 s beside the end-to-end worker); run_world's deadline bounds a hang.


def test_attention_side_refuses_bad_input_before_sending():
    """Bad hidden size, dtype, layer or row count: a clear ValueError, and no process group."""
    cfg = parse_afd_config({"role": "attention", "port": 1})
    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=4, moe_layers=(1, 2, 3))
    conn = resolve_connector("P2pAFDConnector", "attention")(cfg, 0, shape)
    conn._net = object()  # pretend init happened; the checks run before any transport call
    conn._step = StepMetadata(0, StepKind.RUN, (3,))
    cases = [
        (torch.zeros(3, 15), LayerCall(1), "hidden_size"),
        (torch.zeros(3, 16, dtype=torch.bfloat16), LayerCall(1), "dtype"),
        (torch.zeros(3, 16), LayerCall(0), "not an MoE layer"),
        (torch.zeros(3, 16), LayerCall(7), "layer index 7"),
        (torch.zeros(3, 16), LayerCall(1, stage=1), "stage 1 out of range"),
        (torch.zeros(2, 16), LayerCall(1), "announced 3"),
    ]
    for hidden, call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            conn.send_attn_output(hidden, call)


class _RecordingIO:
    """A data plane that records what the attention half asks of it and moves nothing."""

    def __init__(self):
        self.calls = []

    def send_then_post(self, tensor, dst, tag, buf, src, recv_tag, what):
        from afd_common.transport.peer_io import PendingRecv

        self.calls.append(("send_then_post", tuple(tensor.shape), tensor.is_contiguous(), tag))
        assert (src, recv_tag, buf.shape) == (dst, tag, tensor.shape)
        return PendingRecv(None, buf.fill_(7.0), src, what)

    def isend(self, tensor, dst, tag):
        self.calls.append(("isend", tuple(tensor.shape), tensor.is_contiguous(), tag))

    def irecv(self, tensor, src, tag, what):
        from afd_common.transport.peer_io import PendingRecv

        tensor.fill_(7.0)
        return PendingRecv(None, tensor, src, what)

    def wait(self, pending, timeout_s):
        return pending.tensor


def test_one_ffn_rank_path_refuses_what_the_checks_one_by_one_refuse():
    """The one-FFN-rank path checks a call in one condition against what begin_step prepared;
    whatever fails it gets the checks one by one (the same errors as before any step), and a
    valid call that does not fit it (here: not contiguous) takes the general path."""
    from types import SimpleNamespace

    from afd_common.transport.p2p import data_tag

    cfg = parse_afd_config({"role": "attention", "port": 1})
    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=4, moe_layers=(1, 2, 3))
    conn = resolve_connector("P2pAFDConnector", "attention")(cfg, 0, shape)
    io = _RecordingIO()
    conn._net = SimpleNamespace(control=None, data=io)
    routed = conn._rec.routed_rows.get(0, 0)
    conn.begin_step(StepMetadata(0, StepKind.RUN, (3,)))
    for hidden, call, needle in [
        (torch.zeros(3, 15), LayerCall(1), "hidden_size"),
        (torch.zeros(3, 16, dtype=torch.bfloat16), LayerCall(1), "dtype"),
        (torch.zeros(3, 16), LayerCall(0), "not an MoE layer"),
        (torch.zeros(3, 16), LayerCall(7), "layer index 7"),
        (torch.zeros(3, 16), LayerCall(1, stage=1), "stage 1 out of range"),
        (torch.zeros(3, 16), LayerCall(1, stage=-1), "stage -1 out of range"),
        (torch.zeros(2, 16), LayerCall(1), "announced 3"),
    ]:
        with pytest.raises(ValueError, match=needle):
            conn.send_attn_output(hidden, call)
    assert io.calls == []  # nothing was sent for any of them
    pending = conn.send_attn_output(torch.zeros(3, 16), LayerCall(1))
    with pytest.raises(RuntimeError, match="sent twice"):
        conn.send_attn_output(torch.zeros(3, 16), LayerCall(1))
    assert torch.equal(conn.recv_ffn_output(pending), torch.full((3, 16), 7.0))
    with pytest.raises(RuntimeError, match="not in flight"):
        conn.recv_ffn_output(pending)
    strided = torch.zeros(16, 3).t()
    assert torch.equal(conn.recv_ffn_output(conn.send_attn_output(strided, LayerCall(2))),
                       torch.full((3, 16), 7.0))
    assert io.calls == [("send_then_post", (3, 16), True, data_tag(1, 0)),
                        ("isend", (3, 16), True, data_tag(2, 0))]
    conn.end_step()
    assert conn._rec.routed_rows[0] == routed + 6  # both paths' rows reach the metrics


def test_bad_rank_and_role_are_refused_before_any_socket():
    cfg = parse_afd_config({"role": "ffn", "num_ffn_ranks": 2, "port": 1})
    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=1, moe_layers=(0,))
    with pytest.raises(ValueError, match="ffn rank 2 out of range"):
        resolve_connector("P2pAFDConnector", "ffn")(cfg, 2, shape)
    with pytest.raises(ValueError, match="attention half"):
        resolve_connector("P2pAFDConnector", "attention")(cfg, 0, shape)


def test_bad_spec_fails_before_spawning():
    with pytest.raises(AFDConfigError, match="num_ffn_ranks"):
        run_world(Spec(1, 0))


def test_ffn_side_refuses_a_step_larger_than_its_own_limit():
    """A peer that passed the handshake cannot make the FFN side size its receives: a step
    announcing more tokens than this role's max_num_tokens is refused before any allocation."""
    from afd_common.contract import StepPlan
    from afd_common.errors import AFDProtocolError

    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=1, moe_layers=(0,),
                       max_num_tokens=64)
    cfg = parse_afd_config({"role": "ffn", "port": 1, "num_attention_ranks": 2})
    conn = resolve_connector("P2pAFDConnector", "ffn")(cfg, 0, shape)
    ok = StepPlan(0, {0: StepMetadata(0, StepKind.RUN, (32, 32)),
                      1: StepMetadata(0, StepKind.RUN, (0, 64))})
    conn._on_step(ok)
    huge = StepPlan(1, {0: StepMetadata(1, StepKind.RUN, (1, 2**40)),
                        1: StepMetadata(1, StepKind.RUN, (0, 1))})
    with pytest.raises(AFDProtocolError, match="attention rank 0 announced .* more than "
                                               "max_num_tokens 64"):
        conn._on_step(huge)


@pytest.mark.parametrize("connector", ["P2pAFDConnector", "CAMP2pAFDConnector"])
@pytest.mark.parametrize("bad", [-1, 8, 2**31 - 1])
def test_ffn_side_refuses_expert_ids_outside_the_model(connector, bad):
    """With the gate on the attention role the top-k ids arrive off the wire, and the MoE kernels
    index the expert weights with them: an id outside the model is refused, naming the peer."""
    from afd_common.errors import AFDProtocolError
    from afd_common.metadata import WorkItemMeta

    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=1, moe_layers=(0,),
                       num_experts=8, top_k=2)
    cfg = parse_afd_config({"role": "ffn", "port": 1, "connector": connector,
                            "compute_gate_on_attention": True})
    conn = resolve_connector(connector, "ffn")(cfg, 0, shape)
    meta = WorkItemMeta(layer_idx=0, stage=1, step=0, sources=((0, 3),))
    ids = torch.tensor([[0, 7], [1, 2], [3, bad]], dtype=torch.int32)
    with pytest.raises(AFDProtocolError, match=rf"attention rank 0: layer 0 stage 1 routes to "
                                               rf"expert id {bad}, outside \[0, 8\)"):
        conn.work_item(torch.zeros(3, 16), meta, ids, torch.ones(3, 2))
    item = conn.work_item(torch.zeros(3, 16), meta, ids.clamp(0, 7), torch.ones(3, 2))
    assert item.topk_ids.max() == 7
