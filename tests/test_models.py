"""Which models AFD serves, and where their router runs: refused at start, naming the field."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from afd_common.config import parse_afd_config
from afd_common.errors import AFDConfigError
from afd_common.vllm_glue.models import ARCHITECTURES, check_model, check_router, is_routed_expert
from afd_common.tools.tiny_model import ARCHS
from afd_common.vllm_glue.model import weight_category


def _vllm_config(arch: str, speculative: str | None = None):
    hf = SimpleNamespace(architectures=[arch])
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf),
        speculative_config=None if speculative is None else SimpleNamespace(method=speculative))


def _afd(role="attention", **more):
    return parse_afd_config({"role": role, **more}, resolve_connector=False)


def test_every_tiny_checkpoint_is_a_supported_architecture():
    """The table claims only what the e2e tests can serve, and the tests serve all of it."""
    assert sorted(ARCHS.values()) == sorted(ARCHITECTURES)


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_unknown_architecture_is_refused_listing_the_supported(role):
    with pytest.raises(AFDConfigError, match="'architectures' = 'LlamaForCausalLM'") as e:
        check_model(_vllm_config("LlamaForCausalLM"), _afd(role))
    assert all(name in str(e.value) for name in ARCHITECTURES)
    assert "allow_untested_model" in str(e.value)


def test_untested_architecture_with_the_override_is_served_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.afd"):
        assert check_model(_vllm_config("MiniMaxM2ForCausalLM"),
                           _afd(allow_untested_model=True)) is None
    assert "MiniMaxM2ForCausalLM is not among" in caplog.text


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("gate", [True, False])
def test_gate_placement_follows_the_table(arch, gate):
    entry = ARCHITECTURES[arch]
    cfg, afd = _vllm_config(arch), _afd(compute_gate_on_attention=gate)
    if gate or entry.router_in_moe_layer:
        assert check_model(cfg, afd) is entry
    else:
        with pytest.raises(AFDConfigError, match="compute_gate_on_attention.*computes its router"):
            check_model(cfg, afd)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "draft_model", "deepseek_mtp"])
def test_speculative_decoding_with_a_draft_model_is_refused(method):
    with pytest.raises(AFDConfigError, match=f"'speculative_config.method' = '{method}'"):
        check_model(_vllm_config("DeepseekV3ForCausalLM", method), _afd())


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_speculation_is_served(method):
    check_model(_vllm_config("Qwen3MoeForCausalLM", method), _afd())


def test_a_gateless_moe_layer_needs_the_gate_on_attention():
    """For an untested model let through: decided from the built layers on both roles."""
    runners = {1: SimpleNamespace(gate=object()), 2: SimpleNamespace(gate=None)}
    cfg = _vllm_config("SomeMoeForCausalLM")
    with pytest.raises(AFDConfigError, match=r"compute_gate_on_attention.*MoE layers \[2\]"):
        check_router(cfg, runners, gate_on_attention=False)
    check_router(cfg, runners, gate_on_attention=True)
    check_router(cfg, {1: SimpleNamespace(gate=object())}, gate_on_attention=False)


@pytest.mark.parametrize("name,routed", [
    ("model.layers.1.mlp.experts.0.gate_proj.weight", True),  # DeepSeek, Qwen, OLMoE, GLM
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", True),  # Mixtral
    ("model.layers.0.mlp.experts.gate_up_proj_bias", True),  # gpt-oss, stacked
    ("model.layers.1.mlp.shared_experts.gate_proj.weight", False),
    ("model.layers.1.mlp.shared_expert.up_proj.weight", False),  # Qwen2-MoE
    ("model.layers.1.mlp.gate.weight", False),
])
def test_routed_expert_tensors_are_told_apart_from_shared_ones(name, routed):
    """The attention role drops exactly these from the checkpoint."""
    assert is_routed_expert(name) is routed


@pytest.mark.parametrize("name,category", [
    ("model.layers.0.self_attn.qkv_proj.weight", "attention"),
    ("model.layers.0.attn.sinks", "attention"),  # gpt-oss
    ("model.embed_tokens.weight", "embedding"),
    ("model.embedding.weight", "embedding"),  # gpt-oss
    ("model.layers.1.mlp.experts.w13_weight", "routed_experts"),
    ("model.layers.1.mlp.shared_experts.gate_up_proj.weight", "shared_experts"),
    ("model.layers.1.mlp.shared_expert_gate.weight", "shared_experts"),
    ("model.layers.1.mlp.router.weight", "gate"),
    ("model.layers.1.block_sparse_moe.gate.weight", "gate"),
    ("model.layers.1.mlp.gate.e_score_correction_bias", "gate"),
    ("model.layers.0.mlp.gate_up_proj.weight", "dense_mlp"),
])
def test_weights_are_counted_by_category(name, category):
    """What the roles' ``AFD weights:`` lines (and the e2e checks) are made of."""
    assert weight_category(name) == category


REFUSALS_THROUGH_VLLM = r'''
import json, re, sys
from vllm.engine.arg_utils import EngineArgs
from afd_common.vllm_glue.patches import vllm_config

mixtral, dense = sys.argv[1:3]
cases = {
    "gate": dict(model=mixtral, additional_config={"afd": {"role": "attention"}}),
    "architecture": dict(model=dense, additional_config={"afd": {"role": "ffn"}}),
    "speculative": dict(model=mixtral, speculative_config={"method": "draft_model",
                        "model": mixtral, "num_speculative_tokens": 2},
                        additional_config={"afd": {"role": "attention",
                                                   "compute_gate_on_attention": True}}),
}
vllm_config.build().install()
out = {}
for name, kwargs in cases.items():
    try:
        EngineArgs(dtype="float32", max_model_len=256, enforce_eager=True,
                   **kwargs).create_engine_config()
        out[name] = None
    except ValueError as e:  # pydantic wraps afd's AFDConfigError; the user reads this text
        found = re.search(r"afd config: field '([^']+)'", str(e))
        out[name] = found and found.group(1)
print("FIELDS " + json.dumps(out))
'''


def test_refusals_happen_where_vllm_completes_its_config(tmp_path):
    """Through vLLM's own path (EngineArgs -> VllmConfig, where afd's hook runs in the API
    server): each refusal names its field before any engine or process group exists."""
    import json
    import subprocess
    import sys

    from afd_common.tools.tiny_model import write_tiny_model

    mixtral = write_tiny_model("mixtral", tmp_path / "mixtral", num_layers=2)
    dense = write_tiny_model("qwen3_moe", tmp_path / "dense", num_layers=2)
    cfg = json.loads((dense / "config.json").read_text())
    cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")  # a dense model vLLM serves
    (dense / "config.json").write_text(json.dumps(cfg))
    run = subprocess.run([sys.executable, "-c", REFUSALS_THROUGH_VLLM, str(mixtral), str(dense)],
                         capture_output=True, text=True, timeout=300)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("FIELDS ")), None)
    assert line is not None, run.stderr[-3000:]
    assert json.loads(line[len("FIELDS "):]) == {
        "gate": "compute_gate_on_attention", "architecture": "architectures",
        "speculative": "speculative_config.method"}
