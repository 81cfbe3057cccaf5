"""``afd-demo``: a two-role AFD on this machine, answer by answer against a colocated vLLM.

Writes a tiny MoE checkpoint (random weights of real scale, a locally trained tokenizer), serves
it once colocated and once as an FFN role plus an attention role (each its own ``vllm serve``,
each on its own core), sends the same prompts to both and prints the answers side by side, the
weights each server holds by category, and the time of the same requests on both -- each
server warmed up by one request first, so neither time includes a first request's start-up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from afd_common.tools.launch import PROMPTS, Server, afd_args, compare, complete, wait_gone
from afd_common.tools.launch import free_port
from afd_common.tools.tiny_model import write_tiny_model
from afd_common.vllm_glue.model import weight_category


def say(msg: str) -> None:
    print(f"  .. {msg}", flush=True)


def run_colocated(model: Path, prompts, max_tokens, logs: Path):
    server = Server("colocated", str(model), free_port(), logs / "colocated.log", cores="0")
    print("[1/2] colocated vLLM (one `vllm serve`)", flush=True)
    server.start()
    try:
        server.wait_ready(progress=say)
        complete(server, prompts[:1], 2)  # warm-up: a first request's one-time costs
        t0 = time.monotonic()
        answers = complete(server, prompts, max_tokens)
        return answers, time.monotonic() - t0, server.rss_bytes()
    finally:
        server.stop()


def run_afd(model: Path, prompts, max_tokens, logs: Path, gate_on_attention: bool):
    port = free_port()
    extra = {"compute_gate_on_attention": gate_on_attention}
    ffn = Server("FFN role", str(model), free_port(), logs / "ffn.log",
                 args=afd_args("ffn", port, **extra), cores="1")
    attention = Server("attention role", str(model), free_port(), logs / "attention.log",
                       args=afd_args("attention", port, **extra), cores="0")
    print("[2/2] AFD: `vllm serve` as FFN role (core 1) + `vllm serve` as attention role "
          "(core 0)", flush=True)
    ffn.start()
    attention.start()
    try:
        attention.wait_ready(progress=say, others=(ffn,))
        ffn.wait_ready(progress=say, others=(attention,))
        complete(attention, prompts[:1], 2)  # warm-up: a first request's one-time costs
        t0 = time.monotonic()
        answers = complete(attention, prompts, max_tokens)
        held = {"attention role": attention.weights()[0], "FFN role": ffn.weights()[0]}
        return (answers, time.monotonic() - t0, attention.rss_bytes(), ffn.rss_bytes(), held)
    finally:
        attention.signal()  # the attention role first: its goodbye ends the FFN role's world,
        ffn.signal()        # and the FFN role, a service that would wait for the next, is next
        clean = wait_gone((attention, ffn), 30)
        ffn.stop(1), attention.stop(1)
        say("both roles stopped" + ("" if clean else " (some processes had to be killed)"))


def checkpoint_weights(model: Path) -> dict[str, dict[str, int]]:
    """What colocated vLLM holds: every tensor of the checkpoint, by the roles' categories."""
    from safetensors import safe_open

    out: dict[str, dict[str, int]] = {}
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)  # a tiny checkpoint: reading it is cheap
            entry = out.setdefault(weight_category(name), {"numel": 0, "bytes": 0})
            entry["numel"] += t.numel()
            entry["bytes"] += t.nbytes
    return out


def print_weights(servers: dict[str, dict[str, dict[str, int]]]) -> None:
    """Weights held, MiB by category, one column per server: the attention role holds no routed
    expert, the FFN role nothing else."""
    mib = 2 ** 20
    cats = sorted({c for held in servers.values() for c in held})
    print(f"{'weights held (MiB)':<20}" + "".join(f"{name:>16}" for name in servers))
    for cat in cats + ["total"]:
        cells = []
        for held in servers.values():
            n = (sum(e["bytes"] for e in held.values()) if cat == "total"
                 else held.get(cat, {}).get("bytes"))
            cells.append(f"{n / mib:>16.2f}" if n else f"{'-':>16}")
        print(f"{cat:<20}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="deepseek_v2",
                    choices=("deepseek_v2", "deepseek_v3", "qwen3_moe"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--gate-on-attention", action="store_true",
                    help="run gate and top-k on the attention role (default: on the FFN role)")
    ap.add_argument("--workdir", type=Path, help="keep checkpoint and logs here")
    args = ap.parse_args(argv)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="afd-demo-"))
    model = work / f"tiny-{args.arch}"
    print(f"afd demo: tiny {args.arch} checkpoint -> {model}", flush=True)
    write_tiny_model(args.arch, model, seed=0)
    prompts = PROMPTS[:args.prompts]

    ref, ref_s, ref_rss = run_colocated(model, prompts, args.max_tokens, work)
    afd, afd_s, attn_rss, ffn_rss, held = run_afd(model, prompts, args.max_tokens, work,
                                                  args.gate_on_attention)

    print()
    width = 34
    print(f"{'prompt':<28} {'colocated':<{width}} {'AFD (attention + FFN)':<{width}} match")
    for p, a, b in zip(prompts, ref, afd):
        same = a["tokens"] == b["tokens"]
        print(f"{p[:27]:<28} {a['text'][:width - 1]!r:<{width}} "
              f"{b['text'][:width - 1]!r:<{width}} {'yes' if same else 'NO'}")
    problems = compare(afd, ref)
    mib = 2 ** 20
    print()
    print_weights({"colocated": checkpoint_weights(model), **held})
    print(f"RSS (weights, plus the KV cache colocated vLLM and the attention role reserve): "
          f"colocated {ref_rss / mib:.0f} MiB | attention role {attn_rss / mib:.0f} MiB + FFN "
          f"role {ffn_rss / mib:.0f} MiB")
    print(f"time for {len(prompts)} prompts x {args.max_tokens} tokens, each server warmed up "
          f"first: colocated {ref_s:.2f} s, AFD {afd_s:.2f} s (a tiny model on 2 cores: the "
          "numbers show the path works, not what AFD gains; see afd-bench)")
    print(f"logs: {work}")
    if problems:
        print("MISMATCH:\n  " + "\n  ".join(problems))
        return 1
    print(f"all {len(prompts)} answers match the colocated server (tokens equal, logprobs "
          "within 1e-3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
