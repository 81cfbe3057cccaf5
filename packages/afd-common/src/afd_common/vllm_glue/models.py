"""The MoE architectures AFD serves: one table, read by the start-up check (which refuses the
rest before any process group forms), the FFN role's pruning and the README's support table.

What differs between vLLM's MoE models, for AFD, is where the router runs. Some models hand their
gate to vLLM's MoE layer (``gate=``), which then computes the router logits itself: the gate is
part of the MoE block, and either role can route. The others compute the logits in their own
block and pass them to the MoE layer's forward: only the attention role has them, so it routes
and sends the top-k with the rows (``compute_gate_on_attention``). Moving such a model's gate to
the FFN role would mean rewriting its block; refusing the setting is clearer.

Speculative decoding: the model-free proposers (``ngram``, ``suffix``) only make the target model
verify several tokens per step, which AFD serves like any other step. A draft model (MTP, EAGLE,
draft_model, ...) would build MoE layers that are not among the AFD layers the two roles agreed
on, so it is refused at start, not mid-step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from afd_common.config import AFDConfig
from afd_common.errors import AFDConfigError

logger = logging.getLogger("vllm.afd")


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json "architectures"[0]
    vllm_module: str
    # Classes of ``vllm_module`` that only the attention role runs (attention, dense and
    # shared-expert MLPs), by their name there (``Block.attention_cls`` for a class attribute);
    # the FFN role builds them as empty placeholders.
    attention_only: tuple[str, ...]
    router_in_moe_layer: bool  # the model passes gate= to vLLM's MoE layer
    notes: str = ""
    # The model's own RoutedExperts subclass, if any (name in ``vllm_module``): the attention role
    # builds a weightless remote one in its place.
    routed_experts: str | None = None


_DEEPSEEK = "vllm.model_executor.models.deepseek_v2"
_DEEPSEEK_ATTENTION_ONLY = ("DeepseekAttention", "DeepseekV2Attention", "DeepseekV2MLAAttention",
                            "DeepseekV2MLP")

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("DeepseekV2ForCausalLM", _DEEPSEEK, _DEEPSEEK_ATTENTION_ONLY, True,
                 "softmax top-k; shared experts and routed_scaling_factor on the attention role"),
    Architecture("DeepseekV3ForCausalLM", _DEEPSEEK, _DEEPSEEK_ATTENTION_ONLY, True,
                 "noaux_tc: sigmoid scores, e_score_correction_bias, grouped top-k"),
    Architecture("Qwen3MoeForCausalLM", "vllm.model_executor.models.qwen3_moe",
                 ("Qwen3MoeAttention", "Qwen3MoeMLP"), True),
    Architecture("Qwen2MoeForCausalLM", "vllm.model_executor.models.qwen2_moe",
                 ("Qwen2MoeAttention", "Qwen2MoeMLP"), False,
                 "shared expert with its sigmoid gate on the attention role"),
    Architecture("MixtralForCausalLM", "vllm.model_executor.models.mixtral",
                 ("MixtralAttention",), False),
    Architecture("OlmoeForCausalLM", "vllm.model_executor.models.olmoe",
                 ("OlmoeAttention",), False),
    Architecture("Glm4MoeForCausalLM", "vllm.model_executor.models.glm4_moe",
                 ("Glm4MoeAttention", "Glm4MoeMLP"), False,
                 "sigmoid scores with correction bias, grouped top-k, shared experts"),
    Architecture("GptOssForCausalLM", "vllm.model_executor.models.gpt_oss",
                 ("TransformerBlock.attention_cls",), False,
                 "router with a bias, experts with biases and swigluoai, attention sinks and "
                 "sliding windows on the attention role", routed_experts="GptOssRoutedExperts"),
)}

# Proposers that need no model of their own (see the module docstring).
SPECULATIVE_METHODS = ("ngram", "suffix")


def is_routed_expert(name: str) -> bool:
    """A routed expert's tensor, by its checkpoint or module name (every family writes
    ``.experts.``; shared experts are ``shared_expert(s)``)."""
    return ".experts." in name or "routed_experts" in name


def architecture_name(vllm_config) -> str:
    names = getattr(vllm_config.model_config.hf_config, "architectures", None) or ["?"]
    return names[0]


def check_model(vllm_config, afd: AFDConfig) -> Architecture | None:
    """At config time, in the API server: the architecture is one AFD serves (or the user asked to
    try an untested one), the gate sits where that model can route, and no draft model runs.
    Returns the table's entry, or None for an untested model let through."""
    name = architecture_name(vllm_config)
    arch = ARCHITECTURES.get(name)
    if arch is None:
        if not afd.allow_untested_model:
            raise AFDConfigError("architectures", name, "AFD is tested with "
                                 f"{', '.join(ARCHITECTURES)}; to try another model built on "
                                 "vLLM's FusedMoE, set allow_untested_model true in the afd "
                                 "section of both roles")
        logger.warning("AFD: %s is not among the architectures AFD is tested with (%s); "
                       "serving it because allow_untested_model is set", name,
                       ", ".join(ARCHITECTURES))
    elif not arch.router_in_moe_layer and not afd.compute_gate_on_attention:
        raise AFDConfigError("compute_gate_on_attention", False, gate_refusal(name))
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if spec is not None and method not in SPECULATIVE_METHODS:
        raise AFDConfigError("speculative_config.method", method, "AFD serves speculative "
                             f"decoding with the model-free proposers {', '.join(SPECULATIVE_METHODS)}"
                             "; a draft model's layers would run outside the AFD layers both "
                             "roles agreed on")
    return arch


def gate_refusal(name: str) -> str:
    return (f"{name} computes its router logits in its own MoE block, which runs on the "
            "attention role: set it true on both roles")


def check_router(vllm_config, runners: dict[int, object], gate_on_attention: bool) -> None:
    """Once the model is built, for untested models too: a MoE layer without its own gate gets
    its router logits from the model, which only the attention role runs."""
    if gate_on_attention:
        return
    gateless = sorted(layer for layer, runner in runners.items()
                      if getattr(runner, "gate", None) is None)
    if gateless:
        raise AFDConfigError("compute_gate_on_attention", False,
                             gate_refusal(architecture_name(vllm_config))
                             + f" (MoE layers {gateless} have no gate of their own)")
