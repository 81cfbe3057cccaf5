"""P2P connector round trip per layer vs. a raw torch.distributed send/recv of the same bytes.

Two spawned processes (1 attention rank, 1 FFN rank) on this machine. For each token count T the
attention side runs steps of L MoE layers through the connector (control-plane message once per
step, one message per direction per layer, FFN side returns its input) and, interleaved with them,
the same number of raw round trips (send [T, H] then receive [T, H]) on a plain Gloo group. The
per-layer time of the connector is the step time divided by L, so the control plane is paid for.

    uv run --no-sync python benchmarks/transport.py [--layers 16] [--reps 30]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from afd_common.config import parse_afd_config
from afd_common.metadata import LayerCall, ModelShape, StepKind, StepMetadata
from afd_common.registry import resolve_connector
from afd_common.tools.launch import free_port

H = 2048
TOKENS = (1, 16, 128, 512)


def shape(layers: int) -> ModelShape:
    return ModelShape(hidden_size=H, dtype=torch.bfloat16, num_layers=layers,
                      moe_layers=tuple(range(layers)), architecture="bench")


def config(role: str, port: int):
    return parse_afd_config({"role": role, "port": port, "connector": "P2pAFDConnector",
                             "connector_extra_config": {"timeout_s": 60}})


def raw_group(rank: int, port: int):
    return dist.ProcessGroupGloo(
        dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60)), rank, 2,
        _gloo_opts())


def _gloo_opts():
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=60)
    return opts


def ffn_main(args, ports) -> None:
    torch.set_num_threads(1)
    conn = resolve_connector("P2pAFDConnector", "ffn")(config("ffn", ports[0]), 0,
                                                        shape(args.layers))
    raw = raw_group(1, ports[1])
    with conn:
        while True:
            plan = conn.recv_step()
            if plan.kind == StepKind.STOP:
                break
            for layer in range(args.layers):
                item = conn.recv_layer(0, layer)
                conn.send_ffn_output(item.hidden_states, item)
            conn.end_step()
            # The same number of raw round trips, right after.
            t = plan.per_source[0].stage_tokens[0]
            buf = torch.empty(t, H, dtype=torch.bfloat16)
            for _ in range(args.layers):
                raw.recv([buf], 0, 0).wait()
                raw.send([buf], 0, 0).wait()


def attention_main(args, ports, q) -> None:
    torch.set_num_threads(1)
    conn = resolve_connector("P2pAFDConnector", "attention")(config("attention", ports[0]), 0,
                                                              shape(args.layers))
    raw = raw_group(0, ports[1])
    results = {}
    step = 0
    with conn:
        for t in args.tokens:
            x = torch.randn(t, H).to(torch.bfloat16)
            back = torch.empty_like(x)
            afd, base = [], []
            for rep in range(args.reps + 3):
                t0 = time.perf_counter()
                conn.begin_step(StepMetadata(step, StepKind.RUN, (t,)))
                for layer in range(args.layers):
                    y = conn.recv_ffn_output(conn.send_attn_output(x, LayerCall(layer)))
                conn.end_step()
                t1 = time.perf_counter()
                for _ in range(args.layers):
                    raw.send([x], 1, 0).wait()
                    raw.recv([back], 1, 0).wait()
                t2 = time.perf_counter()
                step += 1
                if rep >= 3:  # warm-up
                    afd.append((t1 - t0) / args.layers)
                    base.append((t2 - t1) / args.layers)
            assert torch.equal(y, x) and torch.equal(back, x)
            results[t] = (statistics.median(afd), statistics.median(base))
    q.put(results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (free_port(), free_port())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=ffn_main, args=(args, ports)),
             ctx.Process(target=attention_main, args=(args, ports, q))]
    for p in procs:
        p.start()
    results = None
    while results is None:  # a rank that failed (its traceback is above) ends the run
        try:
            results = q.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                print("a rank failed", file=sys.stderr)
                return 1
    for p in procs:
        p.join(60)
    print(f"P2pAFDConnector vs raw torch.distributed (Gloo, 127.0.0.1), H={H}, bf16, "
          f"median per-layer round trip over {args.reps} steps of {args.layers} layers")
    print(f"{'T':>5} {'connector ms':>13} {'raw ms':>8} {'ratio':>6}")
    for t, (afd, base) in results.items():
        print(f"{t:>5} {afd * 1e3:>13.3f} {base * 1e3:>8.3f} {afd / base:>6.2f}")
    worst = max(a / b for a, b in results.values())
    print(f"worst ratio {worst:.2f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
