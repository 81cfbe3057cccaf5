"""A whole AFD world on one machine, no vLLM: spawned ranks exchanging known data.

Used by the multi-process tests, the transport benchmark and ``afd-selftest`` (a quick check that
both roles' packages and the network between them work). Halves are found through the registry,
so this module imports neither role package.

The FFN side applies a known function per layer; every attention rank checks every result
exactly (integer-valued data, so float32 and bfloat16 are exact)::

    y = x * (layer + 1) + stage            (+ sum(topk_ids) * sum(topk_weights) with the gate)

Async connectors (no control plane) run each (token, expert) row through its own expert and the
attention side combines them, and with sharded experts each FFN rank returns the part of its own
experts, so there the function is per expert ``e``::

    y = sum_k topk_weights[k] * (x * (layer + 1) + stage + topk_ids[k])
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from afd_common.config import AFDConfig, parse_afd_config
from afd_common.contract import ScheduledFFNConnector
from afd_common.metadata import LayerCall, ModelShape, StepKind, StepMetadata
from afd_common.transport import inorder
from afd_common.placement import placement_for
from afd_common.registry import resolve_connector
from afd_common.tools.launch import free_port


@dataclass(frozen=True)
class Spec:
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    connector: str = "P2pAFDConnector"
    steps: int = 3
    num_layers: int = 4
    stages: int = 2
    hidden_size: int = 64
    dtype: str = "float32"
    gate_on_attention: bool = False
    top_k: int = 2
    num_experts: int = 8
    # Experts sharded over the FFN ranks (vLLM's linear EP placement), as --enable-expert-parallel
    sharded: bool = False
    timeout_s: float = 30.0
    port: int = 0
    extra: dict = field(default_factory=dict)
    # Mismatch injection (tests): fields of this spec that differ on the FFN side.
    ffn_changes: dict = field(default_factory=dict)

    def shape(self) -> ModelShape:
        return ModelShape(hidden_size=self.hidden_size, dtype=getattr(torch, self.dtype),
                          num_layers=self.num_layers, moe_layers=tuple(range(self.num_layers)),
                          num_experts=self.num_experts, top_k=self.top_k,
                          architecture="selftest",
                          placement=placement_for(self.num_experts, self.num_ffn_ranks,
                                                  self.sharded))

    def config(self, role: str) -> AFDConfig:
        # A self-test is bounded as a whole: waiting for the peers to turn up too.
        extra = {"timeout_s": self.timeout_s, "connect_timeout_s": self.timeout_s,
                 "num_micro_batches": self.stages, **self.extra}
        return parse_afd_config({
            "role": role, "connector": self.connector, "host": "127.0.0.1", "port": self.port,
            "num_attention_ranks": self.num_attention_ranks, "num_ffn_ranks": self.num_ffn_ranks,
            "compute_gate_on_attention": self.gate_on_attention,
            "connector_extra_config": extra})


def tokens(step: int, rank: int, stage: int) -> int:
    """Token counts that differ per rank, stage and step, with zeros."""
    return (step * 7 + rank * 3 + stage * 5) % 6


def expected(x, layer, stage, ids=None, weights=None):
    y = x * (layer + 1) + stage
    if ids is not None:
        y = y + (ids.sum(-1, dtype=torch.int64).to(torch.float32)
                 * weights.sum(-1)).unsqueeze(-1).to(y.dtype)
    return y


def expected_async(x, layer, stage, ids, weights, mine=None):
    """``mine``: bool [rows, k], the (row, expert) pairs to include (an FFN rank's own)."""
    per_expert = x.to(torch.float32).unsqueeze(1) * (layer + 1) + stage \
        + ids.to(torch.float32).unsqueeze(-1)
    if mine is not None:
        weights = weights * mine
    return (weights.unsqueeze(-1) * per_expert).sum(1).to(x.dtype)


def make_inputs(spec: Spec, step: int, rank: int, layer: int, stage: int, n: int):
    g = torch.Generator().manual_seed(step * 1_000_003 + rank * 1009 + layer * 31 + stage)
    x = torch.randint(-8, 9, (n, spec.hidden_size), generator=g).to(getattr(torch, spec.dtype))
    if not spec.gate_on_attention:
        return x, None, None
    ids = torch.randint(0, spec.num_experts, (n, spec.top_k), generator=g, dtype=torch.int32)
    weights = torch.randint(0, 4, (n, spec.top_k), generator=g).to(torch.float32) / 4
    return x, ids, weights


def rss_mib() -> float:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def attention_rank(spec: Spec, rank: int) -> dict:
    cls = resolve_connector(spec.connector, "attention")
    conn = cls(spec.config("attention"), rank, spec.shape())
    want_fn = expected_async if cls.supports_async_dp or spec.sharded else expected
    checked, warm = 0, None
    with conn:
        for step in range(spec.steps):
            if step == 1:  # after a warm-up step: what grows from here on is held, not set up
                warm = rss_mib()
            counts = tuple(tokens(step, rank, s) for s in range(spec.stages))
            conn.begin_step(StepMetadata(step, StepKind.RUN, counts))
            for layer in range(spec.num_layers):
                inputs, pending = {}, {}
                for stage in range(spec.stages):
                    inputs[stage] = make_inputs(spec, step, rank, layer, stage, counts[stage])
                    pending[stage] = conn.send_attn_output(
                        inputs[stage][0], LayerCall(layer, stage), inputs[stage][1],
                        inputs[stage][2])
                for stage in range(spec.stages):
                    out = conn.recv_ffn_output(pending[stage])
                    want = want_fn(*inputs[stage][:1], layer, stage, *inputs[stage][1:])
                    if not torch.equal(out, want):
                        bad = (out != want).any(-1).nonzero().flatten().tolist()
                        raise AssertionError(f"attention rank {rank} step {step} layer {layer} "
                                             f"stage {stage}: rows {bad[:8]} differ")
                    checked += out.shape[0]
            conn.end_step()
    return {"rows_checked": checked, "rss_growth_mib": _growth(warm)}


def _growth(warm: float | None) -> float | None:
    return None if warm is None else round(rss_mib() - warm, 1)


def ffn_rank(spec: Spec, rank: int) -> dict:
    spec = replace(spec, **spec.ffn_changes)
    cls = resolve_connector(spec.connector, "ffn")
    conn = cls(spec.config("ffn"), rank, spec.shape())
    owners = conn.shape.placement.owner_table if spec.sharded else None
    served = {"rows": 0, "steps": 0}
    warm = None
    with conn:
        if not isinstance(conn, ScheduledFFNConnector):
            return _serve_async(conn, served, spec.num_layers)
        while True:
            plan = conn.recv_step()
            if plan.kind == StepKind.STOP:
                break
            if served["steps"] == 1:
                warm = rss_mib()
            for layer in range(spec.num_layers):
                for stage in range(plan.num_stages):
                    item = conn.recv_layer(stage, layer)
                    if item.num_tokens and owners is not None:
                        y = expected_async(item.hidden_states, layer, stage, item.topk_ids,
                                           item.topk_weights, owners[item.topk_ids.long()] == rank)
                    elif item.num_tokens:
                        y = expected(item.hidden_states, layer, stage, item.topk_ids,
                                     item.topk_weights)
                    if item.num_tokens:
                        conn.send_ffn_output(y, item)
                        served["rows"] += item.num_tokens
            conn.end_step()
            served["steps"] += 1
    return {**served, "rss_growth_mib": _growth(warm)}


def _serve_async(conn, served: dict, warm_after: int) -> dict:
    """The receive loop of an async connector: each item names its layer; row i goes to expert
    ``topk_ids[i, 0]``. Memory is measured from item ``warm_after`` on."""
    served["items"] = 0
    warm = None
    while True:
        item = conn.recv_next(0)
        if served["items"] == warm_after:
            warm = rss_mib()
        if item.meta.is_stop:
            return {**served, "rss_growth_mib": _growth(warm)}
        if item.num_tokens:
            y = item.hidden_states * (item.layer_idx + 1) + item.meta.stage \
                + item.topk_ids.to(item.hidden_states.dtype)
            conn.send_ffn_output(y, item)
            served["rows"] += item.num_tokens
        served["items"] += 1


def _entry(role: str, spec: Spec, rank: int, q, fn=None) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    try:
        fn = fn or (attention_rank if role == "attention" else ffn_rank)
        q.put((role, rank, "ok", fn(spec, rank)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        q.put((role, rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        sys.exit(1)


@dataclass
class RankResult:
    role: str
    rank: int
    status: str  # ok | error | exit
    detail: object
    seconds: float


def run_world(spec: Spec, deadline_s: float = 120.0,
              rank_fns: dict[tuple[str, int], Callable[[Spec, int], dict]] | None = None
              ) -> list[RankResult]:
    """Spawn every rank, wait at most ``deadline_s``, kill leftovers. Never hangs.
    ``rank_fns``: what a rank runs instead of its role's function (picklable), for a caller
    that makes one rank behave otherwise."""
    if spec.port == 0:
        spec = replace(spec, port=free_port())
    spec.config("attention"), spec.config("ffn")  # bad input fails here, before any process
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {}
    start = time.monotonic()
    for role, n in (("ffn", spec.num_ffn_ranks), ("attention", spec.num_attention_ranks)):
        for r in range(n):
            p = ctx.Process(target=_entry, daemon=True,
                            args=(role, spec, r, q, (rank_fns or {}).get((role, r))))
            p.start()
            procs[(role, r)] = p
    results: dict[tuple[str, int], RankResult] = {}
    while len(results) < len(procs) and time.monotonic() - start < deadline_s:
        try:
            role, rank, status, detail = q.get(timeout=0.2)
            results[(role, rank)] = RankResult(role, rank, status, detail,
                                               time.monotonic() - start)
        except Exception:  # noqa: BLE001 - queue.Empty
            for key, p in procs.items():
                if key not in results and p.exitcode is not None:
                    time.sleep(0.2)  # its last message may still be in the pipe
                    if key not in results and q.empty():
                        results[key] = RankResult(*key, "exit", p.exitcode,
                                                  time.monotonic() - start)
    for key, p in procs.items():
        p.join(timeout=max(0.1, deadline_s - (time.monotonic() - start)))
        if p.is_alive():
            p.kill()
            p.join()
        results.setdefault(key, RankResult(*key, "hung", None, time.monotonic() - start))
    return [results[k] for k in sorted(results)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a local AFD world (no vLLM) and check every "
                                 "result exactly.")
    ap.add_argument("--attention-ranks", type=int, default=2)
    ap.add_argument("--ffn-ranks", type=int, default=1)
    ap.add_argument("--connector", default="P2pAFDConnector")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gate-on-attention", action="store_true")
    ap.add_argument("--sharded", action="store_true",
                    help="shard the experts over the FFN ranks (needs --gate-on-attention)")
    args = ap.parse_args(argv)
    cls = resolve_connector(args.connector, "attention")
    # CAMAsync pipelines by construction (one stage) and shards its experts whenever F > 1.
    stages = 1 if cls.supports_async_dp else Spec.stages
    sharded = args.sharded or (cls.supports_async_dp and args.ffn_ranks > 1)
    spec = Spec(args.attention_ranks, args.ffn_ranks, args.connector, steps=args.steps,
                stages=stages, gate_on_attention=args.gate_on_attention, sharded=sharded)
    print(f"afd selftest: {args.connector}, {spec.num_attention_ranks} attention ranks, "
          f"{spec.num_ffn_ranks} FFN ranks ({'sharded' if sharded else 'replicated'} experts), "
          f"{spec.steps} steps x {spec.num_layers} layers x {spec.stages} stages"
          + (", in-order matching" if inorder.enabled() else ""), flush=True)
    results = run_world(spec)
    ok = all(r.status == "ok" for r in results)
    for r in results:
        print(f"  {r.role:9s} rank {r.rank}: {r.status:5s} {r.seconds:5.1f} s  "
              f"{r.detail if r.status == 'ok' else str(r.detail).splitlines()[0]}")
    print("PASS: every result matched" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
