"""``afd-bench``'s options: the load presets, the cores, the model shape, the AFD settings."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

QUICK = {"concurrency": 8, "output_len": 32, "repeats": 1}
FULL = {"concurrency": 16, "output_len": 64, "repeats": 2}  # --preset short
SWEEP = {"concurrency": 8, "output_len": 64, "repeats": 2}  # --preset sweep, at each context
SWEEP_CONTEXTS = "128,512,1024,2048"
MAX_MODEL_LEN = 512  # afd_common.tools.launch.COMMON_ARGS: the least a bench server gets


def parse_cores(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="afd-bench", description="Colocated vLLM (1 and 2 OpenMP threads) against AFD "
        "(attention role on the first core, FFN role on the second) on the same load, side by "
        "side in one run. Writes bench.json and bench.png to --out and prints a table.")
    ap.add_argument("--preset", choices=("short", "sweep"), default="short",
                    help=f"short: one load of --prompt-len tokens ({FULL}); sweep: the same "
                    f"servers measured at each --contexts prompt length ({SWEEP} at each), "
                    "decode and prefill apart, the balance of the roles and an ideal line")
    ap.add_argument("--quick", action="store_true",
                    help=f"short load for a smoke run: {QUICK}")
    ap.add_argument("--contexts",
                    help=f"--preset sweep: prompt lengths in tokens (default {SWEEP_CONTEXTS})")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="default bench-out/")
    ap.add_argument("--micro-batches", default="1,2,3",
                    help="num_micro_batches values for the AFD runs (default 1,2,3)")
    ap.add_argument("--cores", default="0,1", help="two cores: attention/colocated, FFN")
    ap.add_argument("--pin", choices=("process", "omp"), default="process",
                    help="process: the whole server on its cores (like taskset); omp: only "
                    "vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--skip-colocated", action="store_true", help="AFD runs only (no ratios)")
    m = ap.add_argument_group("model (generated with afd_common.tools.tiny_model, float32)")
    m.add_argument("--model", type=Path, help="serve this checkpoint instead of generating one")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="every server's --dtype, colocated and both AFD roles alike (bfloat16 "
                   "needs a CPU with avx512_bf16 or AMX for speed)")
    m.add_argument("--arch", default="qwen3_moe",
                   help="any architecture afd-tiny-model writes (default qwen3_moe)")
    m.add_argument("--hidden-size", type=int, default=1024)
    m.add_argument("--num-layers", type=int, default=8)
    m.add_argument("--num-experts", type=int, default=16)
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--moe-intermediate-size", type=int, default=512)
    m.add_argument("--vocab-size", type=int, default=512)
    m.add_argument("--num-heads", type=int, default=8,
                   help="attention heads (with --head-dim: attention as wide as the hidden size)")
    m.add_argument("--num-kv-heads", type=int, default=4, help="qwen3_moe only")
    m.add_argument("--head-dim", type=int, default=128, help="qwen3_moe only")
    m.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", type=int, help="requests per batch, all at once")
    g.add_argument("--prompt-len", type=int,
                   help="prompt tokens per request (--preset short; default 16)")
    g.add_argument("--output-len", type=int, help="output tokens per request")
    g.add_argument("--repeats", type=int, help="measured batches per configuration")
    g.add_argument("--warmup-tokens", type=int, default=4)
    g.add_argument("--request-timeout", type=float, default=600)
    f = ap.add_argument_group("AFD")
    f.add_argument("--connector", default="P2pAFDConnector")
    f.add_argument("--gate-on-attention", action="store_true",
                   help="compute_gate_on_attention: true")
    f.add_argument("--ffn-ranks", type=int, default=1,
                   help="FFN ranks (the FFN role's --data-parallel-size), all on the FFN core")
    f.add_argument("--sharded", action="store_true",
                   help="shard the experts over the FFN ranks (--enable-expert-parallel on both "
                   "roles; implies --gate-on-attention)")
    h = ap.add_argument_group("hosts (root only)")
    h.add_argument("--hosts", metavar="RATES",
                   help="also run each AFD configuration with the roles on two hosts (network "
                   "namespaces on a bridge, started once per configuration) over the link "
                   "uncapped and capped at each rate, tc syntax: e.g. 100mbit,1gbit,10gbit. "
                   "Results appear as afd_mM@RATE beside the loopback runs")
    ap.add_argument("--kv-cache-gib", type=float,
                    help="KV cache per server (--kv-cache-memory-bytes); default: the model's "
                    "KV bytes per token for every token of the load (concurrency x max model "
                    "length) and a quarter more, at least 0.5")
    ap.add_argument("--ready-timeout", type=float, default=600,
                    help="seconds a server may take to start")
    return ap


def parse_args(argv):
    ap = build_parser()
    args = ap.parse_args(argv)
    load = QUICK if args.quick else SWEEP if args.preset == "sweep" else FULL
    for key, value in load.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sweep = args.preset == "sweep"
    if sweep and args.prompt_len is not None:
        ap.error("--prompt-len is --preset short's: a sweep's prompt lengths are --contexts")
    if not sweep and args.contexts is not None:
        ap.error("--contexts is --preset sweep's: use --prompt-len for one load")
    if args.prompt_len is None:
        args.prompt_len = 16
    try:
        args.mb_list = sorted({int(x) for x in args.micro_batches.split(",") if x.strip()})
        args.core_list = parse_cores(args.cores)
        args.context_list = (sorted({int(x) for x in (args.contexts or SWEEP_CONTEXTS).split(",")
                                     if x.strip()}) if sweep else [])
    except ValueError as e:
        ap.error(f"bad --micro-batches, --cores or --contexts: {e}")
    if not args.mb_list:
        ap.error("--micro-batches takes at least one value, e.g. 1,2,3")
    if args.preset == "sweep" and (not args.context_list or min(args.context_list) < 1):
        ap.error("--contexts takes prompt lengths >= 1, e.g. 128,512,1024,2048")
    if args.preset == "sweep" and args.hosts is not None:
        ap.error("--hosts measures one load: use it with --preset short")
    if len(args.core_list) != 2 or len(set(args.core_list)) != 2:
        ap.error("--cores takes two different cores, e.g. 0,1")
    if args.ffn_ranks < 1:
        ap.error("--ffn-ranks must be >= 1")
    if args.sharded:
        args.gate_on_attention = True
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        ap.error("--kv-cache-gib must be > 0")
    if any(m < 1 for m in args.mb_list):
        ap.error("--micro-batches values must be >= 1")
    if min(args.concurrency, args.output_len, args.repeats, args.prompt_len,
           args.warmup_tokens) < 1:
        ap.error("--concurrency, --output-len, --repeats, --prompt-len, --warmup-tokens must "
                 "be >= 1")
    args.rates = []
    if args.hosts is not None:
        from afd_common.tools.bench.hosts import rate_bits

        args.rates = [r.strip().lower() for r in args.hosts.split(",") if r.strip()]
        try:
            for r in args.rates:
                rate_bits(r)
        except ValueError as e:
            ap.error(f"--hosts: {e}")
        if not args.rates:
            ap.error("--hosts takes at least one rate, e.g. 100mbit,1gbit")
        if os.geteuid() != 0:
            ap.error("--hosts creates network namespaces: run afd-bench as root")
    # The servers' --max-model-len follows the longest prompt (the KV cache follows the load
    # once the model is known: environment.default_kv_cache_gib).
    args.prompt_lens = args.context_list or [args.prompt_len]
    args.max_model_len = max(MAX_MODEL_LEN, max(args.prompt_lens) + args.output_len)
    return args
