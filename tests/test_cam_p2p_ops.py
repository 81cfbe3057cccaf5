"""afd_ascend.a2e / e2a: exact data movement between spawned ranks over Gloo, Meta shapes, and
the loaders' errors."""

import pytest
import torch

import afd_ascend_ops
from op_world import run_op_world

H = 32
TOPK = 3
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows_of(a: int, step: int) -> int:
    return (step * 3 + a * 5) % 7  # zeros included


def inputs(a: int, step: int, dtype):
    g = torch.Generator().manual_seed(1000 * step + a)
    n = rows_of(a, step)
    x = torch.randint(-16, 17, (n, H), generator=g).to(dtype)
    ids = torch.randint(0, 64, (n, TOPK), generator=g, dtype=torch.int32)
    scales = torch.randint(0, 8, (n, TOPK), generator=g).to(torch.float32) / 8
    return x, ids, scales


def ffn_function(x, f, ids=None, scales=None):
    """What FFN rank f returns: proves the rows went to the right rank and came back in order."""
    y = x * (f + 2)
    if ids is not None:
        y = y + (ids.sum(-1).to(torch.float32) * scales.sum(-1)).unsqueeze(-1).to(x.dtype)
    return y


def steps():
    """(step, dtype, compute_gate, padding): every dtype with and without the gate."""
    return [(s, DTYPES[s % 3], s % 2, 3 if s % 4 == 1 else 0) for s in range(8)]


def _a2e_e2a_rank(rank, group, A, F):
    ops = torch.ops.afd_ascend
    checked = 0
    for step, dtype, gate, pad in steps():
        k = TOPK if gate else 0
        common = dict(hidden_size=H, topk=k, expert_rank_size=F, attention_rank_size=A,
                      rank=rank, group_ep=group, compute_gate=gate)
        if rank >= F:  # attention
            a = rank - F
            x, ids, scales = inputs(a, step, dtype)
            out = ops.a2e(x, ids if gate else None, scales if gate else None,
                          batch_size=x.shape[0], **common)
            meta = ops.a2e(x.to("meta"), None, None, batch_size=x.shape[0], **common)
            assert [t.shape for t in out] == [t.shape for t in meta], (out, meta)
            assert out[3].tolist() == [x.shape[0]]
            common.pop("compute_gate")
            y = ops.e2a(torch.empty_like(x), out[3], batch_size=x.shape[0], **common)
            want = ffn_function(x, a % F, ids if gate else None, scales if gate else None)
            assert y.dtype == dtype and torch.equal(y, want), f"step {step} attention {a}"
            assert ops.e2a(x.to("meta"), out[3].to("meta"), **common).shape == y.shape
            checked += y.shape[0]
        else:  # FFN rank f serves a = f, f+F, ...
            sources = list(range(rank, A, F))
            parts = [inputs(a, step, dtype) for a in sources]
            total = sum(p[0].shape[0] for p in parts)
            n = total + pad
            x, ids, scales, counts, active = ops.a2e(
                torch.empty(0, H, dtype=dtype), torch.empty(0, k, dtype=torch.int32),
                torch.empty(0, k, dtype=torch.float32), batch_size=n, **common)
            meta = ops.a2e(torch.empty(0, H, dtype=dtype, device="meta"),
                           torch.empty(0, k, dtype=torch.int32, device="meta"),
                           torch.empty(0, k, dtype=torch.float32, device="meta"),
                           batch_size=n, **common)
            assert [(t.shape, t.dtype) for t in meta] == \
                [(t.shape, t.dtype) for t in (x, ids, scales, counts, active)]
            assert counts.tolist() == [p[0].shape[0] for p in parts]
            assert x.shape == (n, H) and x.dtype == dtype
            assert torch.equal(x[:total], torch.cat([p[0] for p in parts]))
            assert not x[total:].any() and active.tolist() == [True] * total + [False] * pad
            if gate:
                assert torch.equal(ids[:total], torch.cat([p[1] for p in parts]))
                assert torch.equal(scales[:total], torch.cat([p[2] for p in parts]))
            else:
                assert ids.shape == (n, 0)
            y = ffn_function(x, rank, ids if gate else None, scales if gate else None)
            common.pop("compute_gate")
            assert ops.e2a(y, counts, batch_size=n, **common).shape == (0, H)
            checked += total
    return checked


@pytest.mark.multiproc
@pytest.mark.parametrize("A,F,inorder", [(1, 1, False), (2, 1, False), (4, 2, False),
                                         pytest.param(4, 2, True, marks=pytest.mark.inorder)],
                         ids=["1A1F", "2A1F", "4A2F", "4A2F-inorder"])
def test_a2e_e2a_move_rows_exactly(A, F, inorder, monkeypatch):
    if inorder:  # HCCL's in-order matching, emulated on Gloo by the kernels' lanes
        monkeypatch.setenv("AFD_TEST_INORDER", "1")
    checked = run_op_world(_a2e_e2a_rank, A + F, A, F)
    sent = sum(rows_of(a, s) for a in range(A) for s, *_ in steps())
    assert sum(checked[F:]) == sum(checked[:F]) == sent > 0


E = 64  # expert ids in inputs() are drawn from [0, 64)


def _a2e_e2a_m2n_rank(rank, group, A, F):
    """Sharded experts: each row goes to every FFN rank owning one of its experts, and the
    attention side adds the partial results (here x * (f + 2) from rank f) in rank order."""
    from afd_common.placement import expert_owners

    ops = torch.ops.afd_ascend
    owner = torch.tensor(expert_owners(E, F, "linear"), dtype=torch.int64)
    checked = 0
    for step, dtype, _, _ in steps():
        common = dict(hidden_size=H, topk=TOPK, expert_rank_size=F, attention_rank_size=A,
                      rank=rank, group_ep=group, expert_owner=owner)
        if rank >= F:
            a = rank - F
            x, ids, scales = inputs(a, step, dtype)
            out = ops.a2e(x, ids, scales, batch_size=x.shape[0], compute_gate=1, **common)
            meta = ops.a2e(x.to("meta"), ids.to("meta"), scales.to("meta"),
                           batch_size=x.shape[0], compute_gate=1, **common)
            assert [t.shape for t in out] == [t.shape for t in meta], (out, meta)
            routed = out[4]
            want_routed = torch.stack([(owner[ids.long()] == f).any(1) for f in range(F)], 1) \
                if x.shape[0] else torch.zeros(0, F, dtype=torch.bool)
            assert torch.equal(routed, want_routed)
            assert out[3].tolist() == routed.sum(0).tolist()
            y = ops.e2a(torch.empty_like(x), out[3], batch_size=x.shape[0], routed_rows=routed,
                        **common)
            want = sum((x * (f + 2)) * routed[:, f:f + 1].to(dtype) for f in range(F)) \
                if F else None
            assert y.dtype == dtype and torch.equal(y, want), f"step {step} attention {a}"
            checked += int(routed.sum())
        else:
            bound = sum(rows_of(a, step) for a in range(A))
            x, ids, scales, counts, _ = ops.a2e(
                torch.empty(0, H, dtype=dtype), torch.empty(0, TOPK, dtype=torch.int32),
                torch.empty(0, TOPK, dtype=torch.float32), batch_size=bound, compute_gate=1,
                **common)
            assert counts.numel() == A and x.shape == (int(counts.sum()), H)
            # Every row that arrived has an expert here.
            assert bool((owner[ids.long()] == rank).any(1).all()) if x.shape[0] else True
            assert ops.e2a(x * (rank + 2), counts, batch_size=x.shape[0],
                           **common).shape == (0, H)
            checked += x.shape[0]
    return checked


@pytest.mark.multiproc
@pytest.mark.parametrize("A,F,inorder", [(1, 2, False), (2, 3, False),
                                         pytest.param(2, 3, True, marks=pytest.mark.inorder)],
                         ids=["1A2F", "2A3F", "2A3F-inorder"])
def test_a2e_e2a_sharded_experts_m2n(A, F, inorder, monkeypatch):
    if inorder:
        monkeypatch.setenv("AFD_TEST_INORDER", "1")
    checked = run_op_world(_a2e_e2a_m2n_rank, A + F, A, F)
    assert sum(checked[F:]) == sum(checked[:F]) > 0


def _oversized_a2e_rank(rank, group, bound):
    """The attention rank sends 5 rows; the FFN rank accepts at most ``bound``."""
    common = dict(hidden_size=H, expert_rank_size=1, attention_rank_size=1, rank=rank,
                  group_ep=group)
    if rank == 1:
        torch.ops.afd_ascend.a2e(torch.ones(5, H), batch_size=5, **common)
        return "sent"
    with pytest.raises(RuntimeError, match=f"sent 5 rows in total, more than batch_size = "
                                           f"{bound}"):
        torch.ops.afd_ascend.a2e(torch.empty(0, H), batch_size=bound, **common)
    return "refused"


@pytest.mark.multiproc
@pytest.mark.parametrize("bound", [0, 4])
def test_a2e_refuses_more_rows_than_the_ffn_rank_accepts(bound):
    """A peer's row count is never trusted: the FFN side's batch_size bounds what it allocates
    (0 included: no row is expected, none is taken)."""
    assert run_op_world(_oversized_a2e_rank, 2, bound) == ["refused", "sent"]


def test_unknown_group_and_bad_world_are_named():
    afd_ascend_ops.ensure_cam_p2p_ops_available("cpu")
    x = torch.zeros(2, H)
    with pytest.raises(RuntimeError, match="no process group named 'nope'"):
        torch.ops.afd_ascend.a2e(x, hidden_size=H, expert_rank_size=1, attention_rank_size=1,
                                 rank=1, group_ep="nope")
    with pytest.raises(RuntimeError, match="rank 5 outside the world"):
        torch.ops.afd_ascend.e2a(x, torch.tensor([2]), hidden_size=H, expert_rank_size=1,
                                 attention_rank_size=1, rank=5, group_ep="nope")
    with pytest.raises(RuntimeError, match="expert_rank_size must be > 0"):
        torch.ops.afd_ascend.a2e(x, hidden_size=H, attention_rank_size=1, group_ep="g")


def test_loaders_name_missing_ops_backend_and_remedy():
    afd_ascend_ops.ensure_cam_async_ops_available("cpu")  # all six ops have CPU kernels
    assert afd_ascend_ops.ensure_afd_ascend_ops_loaded is afd_ascend_ops.ensure_cam_async_ops_available
    for _ in range(2):  # a failure is not cached
        with pytest.raises(RuntimeError) as e:
            afd_ascend_ops._ensure(("a2e", "no_such_op"), "cpu")
        assert "not defined: no_such_op" in str(e.value) and "'cpu'" in str(e.value)
        assert "reinstall afd-ascend-ops" in str(e.value)
    with pytest.raises(RuntimeError) as e:
        afd_ascend_ops.ensure_cam_p2p_ops_available("cuda")
    assert "no kernel for device 'cuda'" in str(e.value) and "a2e, e2a" in str(e.value)
    assert "Remedy" in str(e.value)


def test_schemas_are_the_deployed_ones():
    """The deployed schemas, plus optional trailing arguments for sharded experts that deployed
    callers never pass (so their calls bind exactly as before)."""
    afd_ascend_ops.ensure_cam_async_ops_available("cpu")
    schema = str(torch.ops.afd_ascend.a2e.default._schema)
    assert schema == ("afd_ascend::a2e(Tensor x, Tensor? expert_ids=None, Tensor? scales=None, "
                      "int batch_size=0, int hidden_size=0, int topk=0, int expert_rank_size=0, "
                      "int attention_rank_size=0, int rank=0, str group_ep=\"\", int aiv_num=0, "
                      "int compute_gate=0, Tensor? expert_owner=None) -> Tensor[]")
    assert str(torch.ops.afd_ascend.e2a.default._schema) == (
        "afd_ascend::e2a(Tensor expand_x, Tensor atten_batch_size, int batch_size=0, "
        "int hidden_size=0, int topk=0, int expert_rank_size=0, int attention_rank_size=0, "
        "int rank=0, str group_ep=\"\", int aiv_num=0, Tensor? expert_owner=None, "
        "Tensor? routed_rows=None) -> Tensor")


def test_a_peer_lost_while_releasing_sends_is_a_lost_peer(monkeypatch):
    """release_sends waits for the last step's sends; a peer killed meanwhile fails it with
    Gloo's error, which must reach the session as a lost peer (that the attention side rides
    through), not as an unknown RuntimeError that ends the worker."""
    from afd_common.errors import AFDPeerError
    from afd_common.transport import cam

    def closed(name):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:1443")
    monkeypatch.setattr(cam, "release_sends", closed)
    half = object.__new__(cam.CAMP2pHalf)
    half._groups, half._peer = ["afd_stage0"], "FFN rank 1"
    with pytest.raises(AFDPeerError, match="last step's sends: lost FFN rank 1"):
        half._release_sends()
