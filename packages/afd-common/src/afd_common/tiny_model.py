"""Tiny random MoE checkpoints that stock vLLM serves, for end-to-end tests and demos.

Real checkpoints are far too big for CI, and a model whose outputs are meaningless is fine as long
as they are deterministic and *sensitive*: AFD moves the MoE half of every layer to another
process, so the tests compare its greedy tokens with plain vLLM's on the same checkpoint. For that
comparison to catch bugs the weights have realistic scales, the router is sharp enough that
different tokens pick different experts, and ``routed_scaling_factor`` is not 1.

Scales: embeddings std 0.02 and norms 1, as real initialisations; projections std 1/sqrt(fan_in),
which is the usual 0.01-0.02 at real widths. A flat 0.02 at hidden 128 shrinks every layer's output
about 4x: attention goes uniform, the model repeats one token whatever the prompt, and swapping
every routed expert changes no token at all, so the tests could not tell right from wrong.

``experts_seed`` reseeds only the routed experts (with ``reseed_experts``, only those expert
indices). A checkpoint that differs from another in nothing else is the negative control: if the
FFN side secretly used its own weights (or none), the two would agree where they must not; with
the experts sharded over FFN ranks, reseeding just one rank's share shows that share is used.

Every tensor is drawn from its own generator, seeded by (stream seed, tensor name), so a tensor's
values do not depend on which other tensors exist or on the order they are written in.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ARCHS: dict[str, str] = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
DEFAULT_SHAPE: dict[str, int] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_experts": 8,
    "top_k": 2,
    "moe_intermediate_size": 64,
    "vocab_size": 512,
    # Attention width: small by default; a benchmark wants attention of real weight
    # (heads x head_dim ~ hidden_size). DeepSeek's MLA takes only the head count.
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_POSITIONS = 2048
# Weight kinds -> std; "linear" is 1/sqrt(fan_in) and "ones" is a norm weight.
STDS: dict[str, float] = {
    "embed": 0.02,
    "router": 0.1,  # logits ~ N(0, 1.1) on normalised input: routing differs token to token
    "bias": 0.05,  # DeepSeek-V3 e_score_correction_bias, big enough to move some top-k picks
}
# DeepSeek MLA: vLLM's CPU MLA backend only takes head size kv_lora_rank + qk_rope_head_dim = 576.
KV_LORA_RANK, QK_ROPE, QK_NOPE, V_HEAD, V3_Q_LORA_RANK = 512, 64, 32, 32, 64

# Written for this module; its only job is to give BPE a few hundred useful merges.
CORPUS = """\
The river runs past the old mill and under the stone bridge before it turns toward the sea. In the
morning the water is grey and quiet, and by noon it shines like a sheet of glass. Children walk
along the bank after school, counting boats and throwing small stones that skip three or four
times before they sink. Nobody remembers when the mill last turned, but everyone agrees that it
should be kept, because the town would not look like itself without it.

A computer does only what it is told, yet it can surprise the people who program it. A program is
a list of instructions, and each instruction is simple: add two numbers, compare them, copy a value
from one place in memory to another. The surprise comes from scale. When a machine performs
billions of these steps every second, patterns appear that no single step could explain, and the
engineers must test, measure and read logs to understand what their own system is doing.

Large language models are trained to predict the next word in a sentence. They read enormous
amounts of text and adjust millions of numbers, called weights, until their guesses improve. A
mixture of experts model splits part of each layer into many small networks, the experts, and a
router chooses which few of them should process each token. Only those experts run, so the model
can be large while each step stays cheap. Serving such a model efficiently means moving data
between machines quickly, keeping every processor busy, and never letting one slow part hold up
the rest.

Bread is one of the oldest foods we know. Flour, water, salt and yeast are mixed into a dough,
which is folded, left to rise, shaped and baked in a hot oven. The crust turns brown and crisp while
the inside stays soft. Bakers start work long before sunrise, and the smell of their ovens drifts
through the empty streets, telling the first travellers of the day that breakfast will soon be
ready.

The weather changed quickly that afternoon. Dark clouds gathered over the hills, the wind picked up
the dry leaves and carried them across the square, and the first heavy drops of rain struck the
windows. People hurried home with their collars raised. An hour later the storm had passed, the
sky was clear again, and the streets smelled of wet earth and fresh air. Questions, answers, numbers
like 1, 2, 3, 10, 42 and 2024, and short lists - red, green, blue - appear in every kind of writing.
"""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _derived_seed(stream_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{stream_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _tensor(name: str, shape: tuple[int, ...], kind: str, stream_seed: int) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32)
    std = shape[-1] ** -0.5 if kind == "linear" else STDS[kind]
    gen = torch.Generator().manual_seed(_derived_seed(stream_seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std



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
        experts = shape["num_experts"]
        n_group = 4 if experts % 4 == 0 else 1
        topk_group = max(1, n_group // 2)
        if topk_group * (experts // n_group) < shape["top_k"]:
            topk_group = n_group
        cfg.update(q_lora_rank=V3_Q_LORA_RANK, topk_method="noaux_tc", scoring_func="sigmoid",
                   n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                   num_nextn_predict_layers=0, rope_interleave=True)
    return cfg


def _qwen3_moe_config(arch: str, shape: dict[str, int], vocab: int, bos: int, eos: int) -> dict:
    cfg = _common_config(arch, shape, vocab, bos, eos)
    cfg.update(
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
        num_experts=shape["num_experts"], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
        router_aux_loss_coef=0.001, output_router_logits=False,
    )
    return cfg


# A tensor spec: (name, shape, kind, is_routed_expert); kind is "ones", "linear" or a key of STDS.

Spec = tuple[str, tuple[int, ...], str, bool]


def _mlp(prefix: str, hidden: int, inter: int, routed: bool = False) -> Iterator[Spec]:
    yield f"{prefix}.gate_proj.weight", (inter, hidden), "linear", routed
    yield f"{prefix}.up_proj.weight", (inter, hidden), "linear", routed
    yield f"{prefix}.down_proj.weight", (hidden, inter), "linear", routed


def _deepseek_tensors(cfg: dict) -> Iterator[Spec]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kv_rank, q_rank = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), "ones", False
        yield f"{p}.post_attention_layernorm.weight", (h,), "ones", False
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
            continue
        experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        yield f"{p}.mlp.gate.weight", (experts, h), "router", False
        if cfg["topk_method"] == "noaux_tc":
            yield f"{p}.mlp.gate.e_score_correction_bias", (experts,), "bias", False
        yield from _mlp(f"{p}.mlp.shared_experts", h, inter * cfg["n_shared_experts"])
        for e in range(experts):
            yield from _mlp(f"{p}.mlp.experts.{e}", h, inter, routed=True)


def _qwen3_moe_tensors(cfg: dict) -> Iterator[Spec]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), "ones", False
        yield f"{p}.post_attention_layernorm.weight", (h,), "ones", False
        a = f"{p}.self_attn"
        yield f"{a}.q_proj.weight", (q_out, h), "linear", False
        yield f"{a}.k_proj.weight", (kv_out, h), "linear", False
        yield f"{a}.v_proj.weight", (kv_out, h), "linear", False
        yield f"{a}.o_proj.weight", (h, q_out), "linear", False
        yield f"{a}.q_norm.weight", (hd,), "ones", False
        yield f"{a}.k_norm.weight", (hd,), "ones", False
        yield f"{p}.mlp.gate.weight", (cfg["num_experts"], h), "router", False
        for e in range(cfg["num_experts"]):
            yield from _mlp(f"{p}.mlp.experts.{e}", h, cfg["moe_intermediate_size"], routed=True)


def _all_tensors(cfg: dict) -> Iterator[Spec]:
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, h), "embed", False
    yield from (_qwen3_moe_tensors if cfg["model_type"] == "qwen3_moe" else _deepseek_tensors)(cfg)
    yield "model.norm.weight", (h,), "ones", False
    yield "lm_head.weight", (vocab, h), "linear", False



def _train_tokenizer(vocab_size: int) -> Any:
    """Byte-level BPE, so any text round-trips; specials first so their ids are small and fixed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    # Prepend BOS the way Llama-style tokenizers do, so vLLM's prompts start with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def _write_tokenizer(out: Path, tok: Any) -> None:
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "special_tokens_map.json",
                {**specials, "additional_special_tokens": list(ROLE_TOKENS)})



def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _expert_index(name: str) -> int:
    return int(name.split(".experts.", 1)[1].split(".", 1)[0])


def write_tiny_model(arch: str, out_dir: str | Path, *, seed: int = 0,
                     experts_seed: int | None = None, reseed_experts=None,
                     **overrides: int) -> Path:
    """Write the checkpoint (config, weights, tokenizer) into ``out_dir`` and return its path.

    ``overrides`` are the keys of ``DEFAULT_SHAPE``. ``vocab_size`` is rounded up to a multiple of
    64; the tokenizer gets as much of it as the corpus supports and the rest are unused rows.
    """
    from safetensors.torch import save_file

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    unknown = set(overrides) - set(DEFAULT_SHAPE)
    if unknown:
        raise TypeError(f"unknown overrides {sorted(unknown)}; allowed: {sorted(DEFAULT_SHAPE)}")
    shape = {**DEFAULT_SHAPE, **{k: int(v) for k, v in overrides.items() if v is not None}}
    if not 0 < shape["top_k"] <= shape["num_experts"]:
        raise ValueError(f"top_k must be in [1, num_experts], got {shape['top_k']}")
    if shape["vocab_size"] < 320:
        raise ValueError("vocab_size must be >= 320 (256 byte tokens, specials and some merges)")
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if arch.startswith("deepseek") and any(shape[k] != DEFAULT_SHAPE[k]
                                           for k in ("num_key_value_heads", "head_dim")):
        raise ValueError("DeepSeek's MLA has fixed head sizes (vLLM's CPU MLA backend): only "
                         "num_attention_heads can change")
    if arch.startswith("deepseek") and shape["num_layers"] < 2:
        raise ValueError("DeepSeek needs num_layers >= 2: layer 0 is dense, the rest are MoE")
    experts_seed = seed if experts_seed is None else experts_seed
    only = None if reseed_experts is None else frozenset(int(e) for e in reseed_experts)
    if only is not None and not only <= set(range(shape["num_experts"])):
        raise ValueError(f"reseed_experts {sorted(only)} outside [0, {shape['num_experts']})")

    def stream(name: str, routed: bool) -> int:
        if routed and (only is None or _expert_index(name) in only):
            return experts_seed
        return seed

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _round_up(shape["vocab_size"], 64)
    tok = _train_tokenizer(vocab)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    make_config = _qwen3_moe_config if arch == "qwen3_moe" else _deepseek_config
    cfg = make_config(arch, shape, vocab, bos, eos)

    tensors = {
        name: _tensor(name, dims, kind, stream(name, routed))
        for name, dims, kind, routed in _all_tensors(cfg)
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file makes it 0600; other users serve it too
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    _write_tokenizer(out, tok)
    _write_json(out / "afd_tiny_model.json", {
        "arch": arch, "seed": seed, "experts_seed": experts_seed,
        "reseed_experts": None if only is None else sorted(only), "shape": shape,
        "vocab_size": vocab, "tokenizer_vocab_size": tok.get_vocab_size(),
        "num_parameters": sum(t.numel() for t in tensors.values()),
    })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="afd-tiny-model", description="Write a tiny random MoE "
                                 "checkpoint that vLLM can serve (vllm serve DIR --dtype float32).")
    ap.add_argument("--arch", required=True, choices=sorted(ARCHS))
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="seeds every tensor but routed experts")
    ap.add_argument("--experts-seed", type=int, default=None,
                    help="seeds the routed experts only (default: --seed)")
    ap.add_argument("--reseed-experts", default=None, metavar="E,E,...",
                    help="apply --experts-seed to these expert indices only (e.g. one FFN "
                    "rank's share, for a negative control)")
    for key, default in DEFAULT_SHAPE.items():
        ap.add_argument("--" + key.replace("_", "-"), dest=key, type=int, help=f"default {default}")
    args = ap.parse_args(argv)
    overrides = {k: getattr(args, k) for k in DEFAULT_SHAPE}
    try:
        only = (None if args.reseed_experts is None
                else [int(e) for e in args.reseed_experts.split(",") if e.strip()])
        out = write_tiny_model(args.arch, args.out, seed=args.seed,
                               experts_seed=args.experts_seed, reseed_experts=only, **overrides)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    info = json.loads((out / "afd_tiny_model.json").read_text())
    print(f"wrote {info['arch']} ({info['num_parameters']:,} parameters, vocab "
          f"{info['vocab_size']}, tokenizer {info['tokenizer_vocab_size']}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
