"""Memory over a long run: many requests through one AFD pair per connector, each role's memory
after a warm-up and at the end, side by side.

Each role is one ``vllm serve`` (1 attention rank, 1 FFN rank, a tiny Qwen3-MoE checkpoint, one
core each); its memory is the resident set of every process of its server. A role that kept
something per step or per request (the portable ops' sent tensors did, up to 4,096 per group)
grows with the request count; one that does not stays within a few percent.

    uv run --no-sync python benchmarks/soak.py [--requests 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from afd_common.tools.launch import BASE_ENV, Server, afd_args, load
from afd_common.tools.launch import free_port
from afd_common.tools.tiny_model import write_tiny_model

CONNECTORS = {
    "CAMP2pAFDConnector": {"compute_gate_on_attention": True},
    "CAMAsyncAFDConnector": {"compute_gate_on_attention": True, "async_dp": True,
                             "connector_extra_config": {"ops_backend": "portable"}},
    "P2pAFDConnector": {"compute_gate_on_attention": True},
}
def soak(connector: str, model: Path, logs: Path, args) -> dict:
    port = free_port()
    env = dict(BASE_ENV)
    afd = CONNECTORS[connector]
    ffn = Server(f"soak-{connector}-ffn", str(model), free_port(), logs / f"{connector}-ffn.log",
                 args=afd_args("ffn", port, connector=connector, **afd), env=env, cores="1")
    attn = Server(f"soak-{connector}-attention", str(model), free_port(),
                  logs / f"{connector}-attention.log",
                  args=afd_args("attention", port, connector=connector, **afd), env=env,
                  cores="0")
    try:
        ffn.start(), attn.start()
        attn.wait_ready(others=(ffn,)), ffn.wait_ready(others=(attn,))
        load(attn, args.warmup, 0, args.concurrency, args.max_tokens)
        before = {"attention": attn.rss_bytes(), "ffn": ffn.rss_bytes()}
        took = load(attn, args.requests, args.warmup, args.concurrency, args.max_tokens)
        after = {"attention": attn.rss_bytes(), "ffn": ffn.rss_bytes()}
    finally:
        attn.stop(10), ffn.stop(10)
    return {"requests": args.requests, "seconds": round(took, 1),
            **{f"{role}_mib": [round(before[role] / 2**20), round(after[role] / 2**20)]
               for role in before},
            **{f"{role}_growth": round(after[role] / before[role] - 1, 4) for role in before}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--connectors", default="CAMP2pAFDConnector,CAMAsyncAFDConnector")
    args = p.parse_args()
    names = args.connectors.split(",")
    for name in names:
        if name not in CONNECTORS:
            p.error(f"--connectors: unknown {name!r}; choose from {', '.join(CONNECTORS)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model("qwen3_moe", root / "model", seed=0)
        results = {}
        for name in names:
            results[name] = soak(name, model, root, args)
            r = results[name]
            print(f"{name}: {r['requests']} requests in {r['seconds']} s; RSS attention "
                  f"{r['attention_mib'][0]} -> {r['attention_mib'][1]} MiB "
                  f"({r['attention_growth']:+.2%}), FFN {r['ffn_mib'][0]} -> {r['ffn_mib'][1]} "
                  f"MiB ({r['ffn_growth']:+.2%})", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
