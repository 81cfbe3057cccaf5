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

import torch

from afd_common.tools.tiny_model.architectures import (ARCH_TABLE, ARCHS, FAN_IN_AXIS, STDS,
                                                 Spec)
from afd_common.tools.tiny_model.tokenizer import (BOS, EOS, train_tokenizer, write_json,
                                             write_tokenizer)

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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _derived_seed(stream_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{stream_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _tensor(name: str, shape: tuple[int, ...], kind: str, stream_seed: int) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32)
    std = shape[FAN_IN_AXIS[kind]] ** -0.5 if kind in FAN_IN_AXIS else STDS[kind]
    gen = torch.Generator().manual_seed(_derived_seed(stream_seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _all_tensors(cfg: dict) -> Iterator[Spec]:
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, h), "embed", False
    yield from ARCH_TABLE[cfg["model_type"]].tensors(cfg)
    yield "model.norm.weight", (h,), "ones", False
    yield "lm_head.weight", (vocab, h), "linear", False


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``experts.{e}.w`` -> ``experts.w``, experts first. They are drawn one by one all the same,
    so that one expert can be reseeded alone."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if ".experts." in name:
            layer, rest = name.split(".experts.", 1)
            e, weight = rest.split(".", 1)
            stacks.setdefault(f"{layer}.experts.{weight}", {})[int(e)] = t
        else:
            out[name] = t
    out.update({name: torch.stack([by_e[e] for e in sorted(by_e)])
                for name, by_e in stacks.items()})
    return out



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
    spec = ARCH_TABLE[arch]
    if spec.dense_first and shape["num_layers"] < 2:
        raise ValueError(f"{arch} needs num_layers >= 2: layer 0 is dense, the rest are MoE")
    if spec.head_dim_from_hidden:
        head_dim, rest = divmod(shape["hidden_size"], shape["num_attention_heads"])
        if rest or overrides.get("head_dim") not in (None, head_dim):
            raise ValueError(f"vLLM's {arch} has head_dim = hidden_size / num_attention_heads: "
                             "head_dim cannot be set, and the heads must divide hidden_size")
        shape["head_dim"] = head_dim
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
    tok = train_tokenizer(vocab)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    cfg = spec.config(arch, shape, vocab, bos, eos)

    tensors = {
        name: _tensor(name, dims, kind, stream(name, routed))
        for name, dims, kind, routed in _all_tensors(cfg)
    }
    if spec.stacked_experts:
        tensors = _stack_experts(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file makes it 0600; other users serve it too
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    write_tokenizer(out, tok)
    write_json(out / "afd_tiny_model.json", {
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
