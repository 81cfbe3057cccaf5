"""Facts about a vLLM model both roles derive the same way: which layers are MoE, the shape.

Reads attributes of objects vLLM hands us; imports nothing from vLLM, so it is safe in any role.
"""

from __future__ import annotations

import re

from afd_common.metadata import ModelShape
from afd_common.vllm_glue.models import ARCHITECTURES, is_routed_expert
from afd_common.placement import ExpertPlacement, placement_for

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``model.layers.3.mlp.experts`` -> 3."""
    m = _LAYER.search(layer_name)
    if m is None:
        raise ValueError(f"cannot find a layer index in module name {layer_name!r}")
    return int(m.group(1))


# Where model configs keep the routed-expert count and the expert-group count.
_NUM_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_NUM_GROUPS_KEYS = ("n_group", "num_expert_group")


def _first_attr(config, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# The attention role's --enable-expert-parallel, kept here once its vLLM flag is switched off
# (afd_common.vllm_glue.patches.vllm_config): it holds no routed experts for vLLM to place.
ATTENTION_EP_KEY = "afd_attention_expert_parallel"


def expert_parallel_requested(vllm_config) -> bool:
    additional = getattr(vllm_config, "additional_config", None) or {}
    return bool(vllm_config.parallel_config.enable_expert_parallel
                or additional.get(ATTENTION_EP_KEY))


def expert_placement(vllm_config, num_ffn_ranks: int) -> ExpertPlacement:
    """The placement this role's vLLM flags ask for, from the model config alone (known before
    the model is built, which the FFN role needs to build only its share)."""
    hf = vllm_config.model_config.hf_text_config
    parallel = vllm_config.parallel_config
    return placement_for(_first_attr(hf, _NUM_EXPERTS_KEYS) or 0, num_ffn_ranks,
                         expert_parallel_requested(vllm_config),
                         parallel.expert_placement_strategy, _first_attr(hf, _NUM_GROUPS_KEYS))


def model_shape(vllm_config, moe_runners: dict[int, object],
                placement: ExpertPlacement | None = None) -> ModelShape:
    """``moe_runners``: layer index -> the MoE runner module of that layer."""
    if not moe_runners:
        arch = ",".join(getattr(vllm_config.model_config.hf_config, "architectures", []) or [])
        raise ValueError(f"model {arch or vllm_config.model_config.model} has no MoE layer AFD "
                         "can disaggregate (AFD serves models built on vLLM's FusedMoE: "
                         f"{', '.join(ARCHITECTURES)})")
    hf = vllm_config.model_config.hf_text_config
    any_runner = next(iter(moe_runners.values()))
    moe = any_runner.moe_config
    if placement is not None and placement.num_experts != moe.num_experts:
        raise ValueError(f"the model config names {placement.num_experts} routed experts, its MoE "
                         f"layers have {moe.num_experts}: AFD cannot place them")
    return ModelShape(
        hidden_size=hf.hidden_size,
        dtype=vllm_config.model_config.dtype,
        num_layers=hf.num_hidden_layers,
        moe_layers=tuple(sorted(moe_runners)),
        num_experts=moe.num_experts,
        top_k=moe.experts_per_token,
        architecture=(getattr(vllm_config.model_config.hf_config, "architectures", None)
                      or ["?"])[0],
        max_num_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        placement=placement or ExpertPlacement(num_experts=moe.num_experts),
    )


def weight_category(name: str) -> str:
    if "self_attn" in name or ".attn." in name:
        return "attention"
    if any(part.startswith("embed") for part in name.split(".")):  # embed_tokens, embedding
        return "embedding"
    if "lm_head" in name:
        return "lm_head"
    if "shared_expert" in name:
        return "shared_experts"
    if is_routed_expert(name) or name.endswith(("w13_weight", "w2_weight")):
        return "routed_experts"
    if (".gate." in name or ".router." in name
            or name.endswith(("gate.weight", "e_score_correction_bias"))):
        return "gate"
    if ".mlp." in name:
        return "dense_mlp"
    if "norm" in name:
        return "norm"
    return "other"


def weight_summary(model) -> dict[str, dict[str, int]]:
    """Parameters held, by category: what a role loaded, in tensors, elements and bytes."""
    out: dict[str, dict[str, int]] = {}
    for name, param in model.named_parameters():
        entry = out.setdefault(weight_category(name), {"tensors": 0, "numel": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["numel"] += param.numel()
        entry["bytes"] += param.numel() * param.element_size()
    return dict(sorted(out.items()))
