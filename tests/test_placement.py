"""Which FFN rank holds expert e: afd's rule equals vLLM's expert-parallel placement, and the
choices a user makes with vLLM's flags are checked before any process group forms."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from afd_common.config import parse_afd_config
from afd_common.errors import AFDConfigError
from afd_common.placement import ExpertPlacement, effective_strategy, placement_for


@settings(max_examples=300, deadline=None)
@given(num_experts=st.integers(1, 300), ranks=st.integers(1, 64),
       strategy=st.sampled_from(["linear", "round_robin"]))
def test_expert_map_equals_vllms(num_experts, ranks, strategy):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    if ranks > num_experts:
        with pytest.raises(AFDConfigError, match="num_ffn_ranks"):
            ExpertPlacement("sharded", num_experts, ranks, strategy).owners
        return
    placement = ExpertPlacement("sharded", num_experts, ranks, strategy)
    for f in range(ranks):
        local, vllm_map, _ = determine_expert_map(ranks, f, num_experts, strategy)
        if ranks == 1:
            assert vllm_map is None and placement.local_experts(0) == tuple(range(num_experts))
            continue
        assert torch.equal(placement.expert_map(f), vllm_map)
        assert len(placement.local_experts(f)) == local
    # Every expert has exactly one owner.
    assert sorted(e for f in range(ranks) for e in placement.local_experts(f)) == \
        list(range(num_experts))


def test_uneven_shares_and_replicated():
    p = placement_for(7, 2, True)
    assert p.sharded and p.local_experts(0) == (0, 1, 2, 3) and p.local_experts(1) == (4, 5, 6)
    assert placement_for(8, 3, True).owners == (0, 0, 0, 1, 1, 1, 2, 2)
    for flags in ((7, 2, False), (7, 1, True)):  # no EP flag, or one FFN rank: replicated
        r = placement_for(*flags)
        assert not r.sharded and r.local_experts(1 if flags[1] > 1 else 0) == tuple(range(7))
        assert r.expert_map(0) is None and r.fingerprint()["expert_owners"] == []


def test_round_robin_falls_back_like_vllm():
    assert effective_strategy("round_robin", None) == "linear"
    assert effective_strategy("round_robin", 1) == "linear"
    assert effective_strategy("round_robin", 8) == "round_robin"
    with pytest.raises(AFDConfigError, match="expert-placement-strategy"):
        effective_strategy("random", None)


def _vllm_config(afd: dict, *, ep: bool, eplb: bool = False, experts: int = 7):
    hf = SimpleNamespace(num_experts=experts)
    return SimpleNamespace(
        additional_config={"afd": afd},
        model_config=SimpleNamespace(hf_text_config=hf, hf_config=hf, is_moe=True),
        parallel_config=SimpleNamespace(
            enable_expert_parallel=ep, enable_eplb=eplb, expert_placement_strategy="linear",
            data_parallel_size=afd.get("num_ffn_ranks", 1), tensor_parallel_size=1,
            pipeline_parallel_size=1, worker_cls="given"))


@pytest.mark.parametrize("role", ["attention", "ffn"])
@pytest.mark.parametrize("ep,eplb,gate,field", [
    (True, False, False, "compute_gate_on_attention"),
    (True, True, True, "enable_eplb"),
])
def test_refusals_name_the_field_on_both_roles(role, ep, eplb, gate, field):
    """Checked where vLLM completes its config: in the API server, before any engine, socket
    or process group exists."""
    from afd_common.vllm_glue.patches.vllm_config import _check_placement

    afd = {"role": role, "num_ffn_ranks": 2, "num_attention_ranks": 2 if role == "ffn" else 2,
           "compute_gate_on_attention": gate}
    cfg = _vllm_config(afd, ep=ep, eplb=eplb)
    with pytest.raises(AFDConfigError, match=field):
        _check_placement(cfg, parse_afd_config(afd))


def test_attention_role_keeps_the_placement_but_not_vllms_expert_parallelism():
    """The attention role holds no routed experts: vLLM's EP is switched off there (an async-DP
    attention engine is not MoE for vLLM, which would refuse it), the placement is kept."""
    from afd_common.vllm_glue.patches.vllm_config import _check_placement
    from afd_common.vllm_glue.model import expert_placement

    afd = {"role": "attention", "num_ffn_ranks": 2, "compute_gate_on_attention": True}
    cfg = _vllm_config(afd, ep=True)
    _check_placement(cfg, parse_afd_config(afd))
    assert cfg.parallel_config.enable_expert_parallel is False
    assert expert_placement(cfg, 2).sharded
    _check_placement(cfg, parse_afd_config(afd))  # vLLM completes the config again per engine
    assert expert_placement(cfg, 2).owners == (0, 0, 0, 0, 1, 1, 1)


def test_sharded_with_gate_on_attention_and_replicated_pass():
    from afd_common.vllm_glue.patches.vllm_config import _check_placement

    for ep, gate in ((True, True), (False, False)):
        afd = {"role": "ffn", "num_ffn_ranks": 2, "compute_gate_on_attention": gate}
        _check_placement(_vllm_config(afd, ep=ep), parse_afd_config(afd))
    afd = {"role": "ffn", "num_ffn_ranks": 8, "compute_gate_on_attention": True}
    with pytest.raises(AFDConfigError, match="num_ffn_ranks"):  # 8 ranks, 7 experts
        _check_placement(_vllm_config(afd, ep=True), parse_afd_config(afd))


def test_handshake_fingerprint_carries_the_placement():
    from afd_common.metadata import ModelShape
    from afd_common.registry import resolve_connector

    def fingerprint(ep: bool, strategy: str = "linear"):
        cfg = parse_afd_config({"role": "ffn", "num_ffn_ranks": 2, "port": 1,
                                "compute_gate_on_attention": True})
        shape = ModelShape(hidden_size=8, dtype=torch.float32, num_layers=1, moe_layers=(0,),
                           num_experts=8, top_k=2,
                           placement=placement_for(8, 2, ep, strategy, num_expert_group=4))
        return resolve_connector("P2pAFDConnector", "ffn")(cfg, 0, shape).fingerprint()

    rep, lin, rr = fingerprint(False), fingerprint(True), fingerprint(True, "round_robin")
    assert rep["expert_placement"] == "replicated" and lin["expert_placement"] == "sharded"
    assert lin["expert_owners"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rr["expert_owners"] == [0, 1, 0, 1, 0, 1, 0, 1] != lin["expert_owners"]
    assert rep["num_experts"] == lin["num_experts"] == 8
