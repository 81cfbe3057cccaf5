"""The architectures ``afd-tiny-model`` writes: per family its config.json and the tensors
vLLM 0.32's model file loads (names, shapes and the kind of random values each gets). Adding an
architecture is one entry in ``ARCH_TABLE``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

MAX_POSITIONS = 4096  # afd-bench --preset sweep serves up to 2048-token prompts and more
# Weight kinds -> std; "ones" is a norm weight. A linear weight's std is 1/sqrt(fan_in), its
# input being the last axis ("linear", torch's layout) or the one before ("linear_t").
FAN_IN_AXIS: dict[str, int] = {"linear": -1, "linear_t": -2}
STDS: dict[str, float] = {
    "embed": 0.02,
    "router": 0.1,  # logits ~ N(0, 1.1) on normalised input: routing differs token to token
    "bias": 0.05,  # e_score_correction_bias: big enough to move some top-k picks
}
# DeepSeek MLA: vLLM's CPU MLA backend only takes head size kv_lora_rank + qk_rope_head_dim = 576.
KV_LORA_RANK, QK_ROPE, QK_NOPE, V_HEAD, V3_Q_LORA_RANK = 512, 64, 32, 32, 64
GPT_OSS_WINDOW = 32  # tokens; the e2e prompts plus 32 output tokens outgrow it



def _common_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    return {
        "architectures": [ARCHS[arch]], "model_type": arch, "torch_dtype": "float32",
        "vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos,
        "hidden_size": shape["hidden_size"], "num_hidden_layers": shape["num_layers"],
        "intermediate_size": 4 * shape["moe_intermediate_size"],  # dense layers, if any
        "moe_intermediate_size": shape["moe_intermediate_size"],
        "num_experts_per_tok": shape["top_k"],
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": STDS["embed"],
        "tie_word_embeddings": False, "use_cache": True,
    }


def _gqa_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    cfg = _common_config(arch, shape, vocab, bos, eos)
    cfg.update(num_attention_heads=shape["num_attention_heads"],
               num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"])
    return cfg


def _expert_groups(shape: dict[str, int]) -> tuple[int, int]:
    """Group-limited routing that really limits: half of 4 groups, unless that leaves fewer than
    top_k experts to choose from."""
    experts = shape["num_experts"]
    n_group = 4 if experts % 4 == 0 else 1
    topk_group = max(1, n_group // 2)
    if topk_group * (experts // n_group) < shape["top_k"]:
        topk_group = n_group
    return n_group, topk_group


def _deepseek_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    """V2 is the V2-Lite recipe (no q LoRA, softmax, greedy top-k); V3 adds a q LoRA, sigmoid
    scores with a correction bias and group-limited routing, so both MLA and both routers run.

    RoPE is YaRN with factor 1 (the same frequencies as plain RoPE), as in real DeepSeek configs.
    With rope_type "default" vLLM 0.32 on CPU uses its C++ rotary kernel, which rotates MLA's
    strided 3-D q/k_pe views wrongly for prompts over one token (output then depends on the batch);
    the YaRN class runs in PyTorch, and vLLM then matches transformers token for token.
    """
    cfg = _common_config(arch, shape, vocab, bos, eos)
    cfg["rope_parameters"] = {
        "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_POSITIONS,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "rope_theta": cfg["rope_theta"],
    }
    cfg.update(
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_attention_heads"], kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=QK_ROPE, qk_nope_head_dim=QK_NOPE, v_head_dim=V_HEAD,
        n_routed_experts=shape["num_experts"], n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, moe_layer_freq=1,
    )
    if arch == "deepseek_v2":
        cfg.update(q_lora_rank=None, topk_method="greedy", scoring_func="softmax",
                   n_group=1, topk_group=1, norm_topk_prob=False)
    else:
        n_group, topk_group = _expert_groups(shape)
        cfg.update(q_lora_rank=V3_Q_LORA_RANK, topk_method="noaux_tc", scoring_func="sigmoid",
                   n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                   num_nextn_predict_layers=0, rope_interleave=True)
    return cfg


def _qwen3_moe_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    cfg = _gqa_config(arch, shape, vocab, bos, eos)
    cfg.update(
        num_experts=shape["num_experts"], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
        router_aux_loss_coef=0.001, output_router_logits=False,
    )
    return cfg


def _qwen2_moe_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    """Qwen1.5-MoE's recipe: a shared expert as wide as four routed ones behind a sigmoid gate,
    and top-k weights left unnormalised."""
    cfg = _common_config(arch, shape, vocab, bos, eos)
    cfg.update(
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], num_experts=shape["num_experts"],
        shared_expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
        router_aux_loss_coef=0.001, output_router_logits=False,
    )
    return cfg


def _mixtral_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    cfg = _gqa_config(arch, shape, vocab, bos, eos)
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")  # no dense or shared MLPs
    cfg.update(num_local_experts=shape["num_experts"], sliding_window=None,
               router_aux_loss_coef=0.001, output_router_logits=False)
    return cfg


def _olmoe_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    """vLLM's OLMoE hard-codes norm eps 1e-5 and unnormalised top-k weights; the config says the
    same, so transformers computes what vLLM does."""
    cfg = _common_config(arch, shape, vocab, bos, eos)
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")  # no dense or shared MLPs
    cfg.update(
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], num_experts=shape["num_experts"],
        norm_topk_prob=False, rms_norm_eps=1e-5, clip_qkv=None, router_aux_loss_coef=0.01,
        output_router_logits=False,
    )
    return cfg


def _glm4_moe_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    """GLM-4.5's recipe: DeepSeek-V3's router (sigmoid, correction bias, group-limited top-k,
    routed_scaling_factor) on grouped-query attention with q/k/v bias, per-head q/k norms and
    RoPE on half of each head."""
    cfg = _gqa_config(arch, shape, vocab, bos, eos)
    n_group, topk_group = _expert_groups(shape)
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.5
    cfg.update(
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        n_routed_experts=shape["num_experts"], n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
        num_nextn_predict_layers=0,
    )
    return cfg


def _gpt_oss_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    """Sliding-window attention on the even layers (vLLM goes by layer index, transformers by
    layer_types, which say the same), with a window that a test's prompt plus output outgrows, so
    it really cuts. RoPE is YaRN with factor 1: vLLM's gpt-oss builds YaRN whatever the config."""
    cfg = _gqa_config(arch, shape, vocab, bos, eos)
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")  # no dense or shared MLPs
    cfg["rope_parameters"] = {
        "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_POSITIONS,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": cfg["rope_theta"],
    }
    cfg.update(
        num_local_experts=shape["num_experts"], attention_bias=True, rms_norm_eps=1e-5,
        swiglu_limit=7.0, sliding_window=GPT_OSS_WINDOW,
        layer_types=["full_attention" if i % 2 else "sliding_attention"
                     for i in range(shape["num_layers"])],
        router_aux_loss_coef=0.001, output_router_logits=False,
    )
    return cfg


# A tensor spec: (name, shape, kind, is_routed_expert); kind is "ones", a key of FAN_IN_AXIS or
# a key of STDS.

Spec = tuple[str, tuple[int, ...], str, bool]
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def _mlp(prefix: str, hidden: int, inter: int, routed: bool = False,
         names: tuple[str, str, str] = GATE_UP_DOWN) -> Iterator[Spec]:
    gate, up, down = names
    yield f"{prefix}.{gate}.weight", (inter, hidden), "linear", routed
    yield f"{prefix}.{up}.weight", (inter, hidden), "linear", routed
    yield f"{prefix}.{down}.weight", (hidden, inter), "linear", routed


def _norms(layer: str, hidden: int) -> Iterator[Spec]:
    yield f"{layer}.input_layernorm.weight", (hidden,), "ones", False
    yield f"{layer}.post_attention_layernorm.weight", (hidden,), "ones", False


def _attention(prefix: str, cfg: dict, head_dim: int, qkv_bias: bool = False) -> Iterator[Spec]:
    h = cfg["hidden_size"]
    q_out, kv_out = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    for proj, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
        yield f"{prefix}.{proj}_proj.weight", (out, h), "linear", False
        if qkv_bias:
            yield f"{prefix}.{proj}_proj.bias", (out,), "bias", False
    yield f"{prefix}.o_proj.weight", (h, q_out), "linear", False


def _routed_moe(prefix: str, cfg: dict, experts: int, inter: int,
                names: tuple[str, str, str] = GATE_UP_DOWN) -> Iterator[Spec]:
    h = cfg["hidden_size"]
    yield f"{prefix}.gate.weight", (experts, h), "router", False
    for e in range(experts):
        yield from _mlp(f"{prefix}.experts.{e}", h, inter, routed=True, names=names)


def _shared_experts_moe(prefix: str, cfg: dict, correction_bias: bool) -> Iterator[Spec]:
    h, experts, inter = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    yield f"{prefix}.gate.weight", (experts, h), "router", False
    if correction_bias:
        yield f"{prefix}.gate.e_score_correction_bias", (experts,), "bias", False
    yield from _mlp(f"{prefix}.shared_experts", h, inter * cfg["n_shared_experts"])
    for e in range(experts):
        yield from _mlp(f"{prefix}.experts.{e}", h, inter, routed=True)


def _deepseek_tensors(cfg: dict) -> Iterator[Spec]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kv_rank, q_rank = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        a = f"{p}.self_attn"
        if q_rank:
            yield f"{a}.q_a_proj.weight", (q_rank, h), "linear", False
            yield f"{a}.q_a_layernorm.weight", (q_rank,), "ones", False
            yield f"{a}.q_b_proj.weight", (heads * qk_dim, q_rank), "linear", False
        else:
            yield f"{a}.q_proj.weight", (heads * qk_dim, h), "linear", False
        kv_a_out = kv_rank + cfg["qk_rope_head_dim"]  # latent, then the shared rope key
        yield f"{a}.kv_a_proj_with_mqa.weight", (kv_a_out, h), "linear", False
        yield f"{a}.kv_a_layernorm.weight", (kv_rank,), "ones", False
        kv_b_out = heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        yield f"{a}.kv_b_proj.weight", (kv_b_out, kv_rank), "linear", False
        yield f"{a}.o_proj.weight", (h, heads * cfg["v_head_dim"]), "linear", False
        if i < cfg["first_k_dense_replace"]:
            yield from _mlp(f"{p}.mlp", h, cfg["intermediate_size"])
        else:
            yield from _shared_experts_moe(f"{p}.mlp", cfg, cfg["topk_method"] == "noaux_tc")


def _qwen3_moe_tensors(cfg: dict) -> Iterator[Spec]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(f"{p}.self_attn", cfg, hd)
        yield f"{p}.self_attn.q_norm.weight", (hd,), "ones", False
        yield f"{p}.self_attn.k_norm.weight", (hd,), "ones", False
        yield from _routed_moe(f"{p}.mlp", cfg, cfg["num_experts"], cfg["moe_intermediate_size"])


def _qwen2_moe_tensors(cfg: dict) -> Iterator[Spec]:
    h = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(f"{p}.self_attn", cfg, h // cfg["num_attention_heads"],
                              qkv_bias=True)
        yield f"{p}.mlp.shared_expert_gate.weight", (1, h), "router", False
        yield from _mlp(f"{p}.mlp.shared_expert", h, cfg["shared_expert_intermediate_size"])
        yield from _routed_moe(f"{p}.mlp", cfg, cfg["num_experts"], cfg["moe_intermediate_size"])


def _mixtral_tensors(cfg: dict) -> Iterator[Spec]:
    h = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(f"{p}.self_attn", cfg, cfg["head_dim"])
        yield from _routed_moe(f"{p}.block_sparse_moe", cfg, cfg["num_local_experts"],
                               cfg["intermediate_size"], names=("w1", "w3", "w2"))


def _olmoe_tensors(cfg: dict) -> Iterator[Spec]:
    h, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(f"{p}.self_attn", cfg, hd)
        # OLMoE normalises q and k over all heads at once, not per head.
        yield f"{p}.self_attn.q_norm.weight", (heads * hd,), "ones", False
        yield f"{p}.self_attn.k_norm.weight", (kv_heads * hd,), "ones", False
        yield from _routed_moe(f"{p}.mlp", cfg, cfg["num_experts"], cfg["intermediate_size"])


def _glm4_moe_tensors(cfg: dict) -> Iterator[Spec]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(f"{p}.self_attn", cfg, hd, qkv_bias=True)
        yield f"{p}.self_attn.q_norm.weight", (hd,), "ones", False
        yield f"{p}.self_attn.k_norm.weight", (hd,), "ones", False
        if i < cfg["first_k_dense_replace"]:
            yield from _mlp(f"{p}.mlp", h, cfg["intermediate_size"])
        else:
            yield from _shared_experts_moe(f"{p}.mlp", cfg, correction_bias=True)


def _gpt_oss_tensors(cfg: dict) -> Iterator[Spec]:
    h, hd, heads = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"]
    inter = cfg["intermediate_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        yield from _norms(p, h)
        yield from _attention(a, cfg, hd, qkv_bias=True)
        yield f"{a}.o_proj.bias", (h,), "bias", False
        yield f"{a}.sinks", (heads,), "bias", False
        yield f"{m}.router.weight", (cfg["num_local_experts"], h), "router", False
        yield f"{m}.router.bias", (cfg["num_local_experts"],), "bias", False
        for e in range(cfg["num_local_experts"]):
            x = f"{m}.experts.{e}"
            yield f"{x}.gate_up_proj", (h, 2 * inter), "linear_t", True  # gate/up interleaved
            yield f"{x}.gate_up_proj_bias", (2 * inter,), "bias", True
            yield f"{x}.down_proj", (inter, h), "linear_t", True
            yield f"{x}.down_proj_bias", (h,), "bias", True


class Arch(NamedTuple):
    architecture: str  # config.json "architectures"[0]
    config: Callable[[str, dict[str, int], int, int, int], dict]
    tensors: Callable[[dict], Iterator[Spec]]
    dense_first: bool = False  # layer 0 is a dense MLP, so num_layers >= 2
    head_dim_from_hidden: bool = False  # vLLM sizes heads hidden_size / num_attention_heads
    stacked_experts: bool = False  # the checkpoint holds all of a layer's experts in one tensor


ARCH_TABLE: dict[str, Arch] = {
    "deepseek_v2": Arch("DeepseekV2ForCausalLM", _deepseek_config, _deepseek_tensors,
                        dense_first=True),
    "deepseek_v3": Arch("DeepseekV3ForCausalLM", _deepseek_config, _deepseek_tensors,
                        dense_first=True),
    "qwen3_moe": Arch("Qwen3MoeForCausalLM", _qwen3_moe_config, _qwen3_moe_tensors),
    "qwen2_moe": Arch("Qwen2MoeForCausalLM", _qwen2_moe_config, _qwen2_moe_tensors,
                      head_dim_from_hidden=True),
    "mixtral": Arch("MixtralForCausalLM", _mixtral_config, _mixtral_tensors),
    "olmoe": Arch("OlmoeForCausalLM", _olmoe_config, _olmoe_tensors, head_dim_from_hidden=True),
    "glm4_moe": Arch("Glm4MoeForCausalLM", _glm4_moe_config, _glm4_moe_tensors,
                     dense_first=True),
    "gpt_oss": Arch("GptOssForCausalLM", _gpt_oss_config, _gpt_oss_tensors,
                    stacked_experts=True),
}
ARCHS: dict[str, str] = {name: arch.architecture for name, arch in ARCH_TABLE.items()}
