"""CAMAsyncAFDConnector between spawned ranks over Gloo (portable afd_ascend kernels): the FFN
side is a receive loop whose items name their own layer; experts are sharded over FFN ranks."""

import pytest
import torch

from afd_common.config import parse_afd_config
from afd_common.metadata import ModelShape
from afd_common.registry import resolve_connector
from afd_common.tools.selftest import Spec, run_world

pytestmark = pytest.mark.multiproc

TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (3, 2)]


def assert_all_ok(results, spec):
    msgs = [f"{r.role} {r.rank}: {r.status} {r.detail}" for r in results if r.status != "ok"]
    assert not msgs, "\n".join(msgs)
    checked = sum(r.detail["rows_checked"] for r in results if r.role == "attention")
    served = sum(r.detail["rows"] for r in results if r.role == "ffn")
    # Every (token, expert) row went to exactly one FFN rank.
    assert served == checked * spec.top_k > 0


@pytest.mark.parametrize("A,F", TOPOLOGIES, ids=[f"{a}A{f}F" for a, f in TOPOLOGIES])
def test_topologies_exact(A, F):
    spec = Spec(A, F, connector="CAMAsyncAFDConnector", steps=4, num_layers=4, stages=1,
                gate_on_attention=True, sharded=F > 1, timeout_s=30)
    assert_all_ok(run_world(spec), spec)


def test_refuses_replicated_or_round_robin_experts_over_several_ranks():
    """CAMAsync addresses expert e on FFN rank e // R: a placement that differs is refused."""
    from afd_common.placement import ExpertPlacement

    cfg = parse_afd_config({"role": "ffn", "connector": "CAMAsyncAFDConnector", "port": 1,
                            "num_ffn_ranks": 2, "compute_gate_on_attention": True})
    for placement, field in ((ExpertPlacement("replicated", 8, 2), "enable_expert_parallel"),
                             (ExpertPlacement("sharded", 8, 2, "round_robin"),
                              "expert_placement_strategy")):
        shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=1, moe_layers=(0,),
                           num_experts=8, top_k=2, placement=placement)
        with pytest.raises(ValueError, match=field):
            resolve_connector("CAMAsyncAFDConnector", "ffn")(cfg, 0, shape)


@pytest.mark.inorder
@pytest.mark.parametrize("A,F", [(2, 2)], ids=["2A2F"])
def test_orderings_are_safe_under_inorder_matching(monkeypatch, A, F):
    """HCCL matches point-to-point operations in posting order: the FFN rank re-posts an
    attention rank's header receive only after returning that rank's rows."""
    monkeypatch.setenv("AFD_TEST_INORDER", "1")
    spec = Spec(A, F, connector="CAMAsyncAFDConnector", steps=3, num_layers=3, stages=1,
                gate_on_attention=True, sharded=F > 1, timeout_s=20)
    assert_all_ok(run_world(spec), spec)


def test_bf16():
    spec = Spec(2, 1, connector="CAMAsyncAFDConnector", steps=3, stages=1,
                gate_on_attention=True, dtype="bfloat16", timeout_s=30)
    assert_all_ok(run_world(spec), spec)


@pytest.mark.parametrize("afd,field", [
    ({"compute_gate_on_attention": False}, "compute_gate_on_attention"),
    ({"compute_gate_on_attention": True, "num_ffn_ranks": 3}, "num_ffn_ranks"),
    ({"compute_gate_on_attention": True,
      "connector_extra_config": {"num_micro_batches": 2}}, "num_micro_batches"),
])
def test_refused_before_any_socket(afd, field):
    shape = ModelShape(hidden_size=16, dtype=torch.float32, num_layers=1, moe_layers=(0,),
                       num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=field):
        cfg = parse_afd_config({"role": "ffn", "connector": "CAMAsyncAFDConnector", "port": 1,
                                **afd})
        resolve_connector("CAMAsyncAFDConnector", "ffn")(cfg, 0, shape)
