"""``afd-bench --preset sweep``: the same servers measured at several context lengths, decode
apart from prefill, to find where AFD pays on this machine.

At a short context the experts are the whole step and the attention role idles; at a long one
the attention (reading the KV cache) dominates and the FFN role idles. Where the two roles'
per-step compute is closest (``balance_context``) their overlap hides the most, and there AFD
must come out ahead. Each context's entries are decode-only (``afd_common.tools.bench.stats``);
the AFD ones carry the ideal step -- perfect overlap, no split cost -- so the chart shows how far
the implementation is from its own limit as well as from colocated vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from afd_common.tools.bench import report, stats

COLOCATED = ("colocated_t1", "colocated_t2")
# A sweep entry's numbers: decode-only where a short run's are end to end (stats' docstring).
KEYS = ["status", "decode_tokens_per_s", "ratio_vs_colocated", "tpot_p50_ms", "tpot_p99_ms",
        "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "decode_window_s", "tokens_per_s",
        "startup_s", "error"]
AFD_KEYS = ["t_a_ms", "t_e_ms", "t_c_ms", "roundtrip_ms", "t_step_ms", "eta", "ideal_step_ms",
            "ideal_ratio_vs_colocated", "attention_compute_ms_per_step",
            "attention_wait_ms_per_step", "ffn_compute_ms_per_step", "bytes_per_step", "sizing"]


def _decode_view(result: dict | None, afd: bool) -> dict:
    r = result or report.empty_result()
    out = {k: r.get(k) for k in KEYS}
    for k in ("tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        out[k] = r.get(f"decode_{k}")
    if afd:
        out.update({k: r.get(k) for k in AFD_KEYS})
    return out


def contexts(results: dict[str, dict], args, moe_layers: int) -> dict[str, dict]:
    """``results`` keyed ``"<context>/<config>"`` -> ``{"<context>": {config: entry}}``, each
    context with ``colocated`` (the faster colocated setting in decode tokens per second), the
    ratios to it, and each AFD entry's ideal step."""
    afd = [f"afd_m{m}" for m in args.mb_list]
    out = {}
    for c in args.context_list:
        entries = {n: _decode_view(results.get(f"{c}/{n}"), n in afd) for n in (*COLOCATED, *afd)}
        best = stats.faster({n: entries[n] for n in COLOCATED
                             if entries[n]["status"] == "ok"}, key="decode_tokens_per_s")
        base = best[1]["decode_tokens_per_s"] if best else None
        for name, e in entries.items():
            e["ratio_vs_colocated"] = stats.ratio(e["decode_tokens_per_s"], base)
            if name in afd:
                m = int(name[5:])
                ideal = stats.ideal_step_ms(m, moe_layers, e["t_a_ms"], e["t_e_ms"],
                                            e["t_step_ms"], e["itl_p50_ms"])
                e["ideal_step_ms"] = ideal
                e["ideal_ratio_vs_colocated"] = (stats.ratio(args.concurrency * 1000 / ideal,
                                                             base) if ideal else None)
        colocated = ({**best[1], "source": best[0]} if best
                     else {**_decode_view(None, False), "source": None})
        out[str(c)] = {"colocated": colocated, **entries}
    return out


def verdicts(doc: dict[str, dict]) -> list[str]:
    """Each context's measured split cost (kept in its AFD entries) and fastest m, as afd-bench
    prints them."""
    out = []
    for c, entries in doc.items():
        line = stats.mark_split_cost({int(n[5:]): e for n, e in entries.items()
                                      if n.startswith("afd_m")})
        if line:
            out.append(f"{c}: {line}")
    return out


def balance_context(doc: dict[str, dict], args) -> int | None:
    """Where the roles' per-step compute is closest, read off the unsplit AFD run (the smallest
    m measured): splitting moves time between the roles' waits, not their compute."""
    name = f"afd_m{min(args.mb_list)}"
    return stats.balance_context({int(c): (e[name]["attention_compute_ms_per_step"],
                                           e[name]["ffn_compute_ms_per_step"])
                                  for c, e in doc.items() if name in e})


def write_json(path: Path, setup: dict, doc: dict[str, dict], balance: int | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setup": setup, "balance_context": balance, "contexts": doc},
                               indent=2) + "\n")
    return path


COLUMNS = [("context", None, 0), ("config", None, 0),
           ("dec tok/s", "decode_tokens_per_s", 1), ("vs coloc", "ratio_vs_colocated", 2),
           ("ideal vs", "ideal_ratio_vs_colocated", 2), ("TPOT p50", "tpot_p50_ms", 1),
           ("ITL p99", "itl_p99_ms", 1), ("TTFT p50", "ttft_p50_ms", 0),
           ("t_a", "t_a_ms", 3), ("t_e", "t_e_ms", 3), ("t_c", "t_c_ms", 3), ("eta", "eta", 2),
           ("ideal step", "ideal_step_ms", 1), ("attn/step", "attention_compute_ms_per_step", 1),
           ("ffn/step", "ffn_compute_ms_per_step", 1)]


def table(doc: dict[str, dict], balance: int | None) -> str:
    rows = []
    for c, entries in doc.items():
        for name, e in entries.items():
            if e.get("status") == "not run":
                continue
            mark = " <- balance" if name == "colocated" and int(c) == balance else ""
            rows.append([c + mark, report.label(name, e)]
                        + [report.fmt(e.get(key), d) for _, key, d in COLUMNS[2:]])
    return report.render([h for h, _, _ in COLUMNS], rows, 2,
                         "(decode only; times in ms; t_a/t_e/t_c per MoE layer and "
                         "micro-batch; TTFT is the prefill)")


def write_chart(path: Path, doc: dict[str, dict], balance: int | None, afd: list[str],
                title: str = "") -> Path | None:
    """Left: AFD's decode throughput over the faster colocated one against context length, each
    m and the best ideal. Right: each role's compute per decode step (the unsplit AFD run)
    beside the colocated decode step. The balance context is marked on both."""
    plt = report.pyplot()
    if plt is None:
        return None
    xs = sorted(int(c) for c in doc)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.0, 4.8))

    def series(name: str, key: str) -> list[float]:
        return [doc[str(c)][name].get(key) or float("nan") for c in xs]

    for name in afd:
        left.plot(xs, series(name, "ratio_vs_colocated"), marker="o", label=name)
    ideal = [max((doc[str(c)][n].get("ideal_ratio_vs_colocated") or 0.0 for n in afd),
                 default=0.0) or float("nan") for c in xs]
    left.plot(xs, ideal, linestyle="--", color="black", label="ideal (best m)")
    left.axhline(1.0, color="gray", linewidth=1)
    left.set_ylabel("decode tokens/s vs faster colocated")
    left.set_title("AFD / colocated, decode")

    unsplit = min(afd, key=lambda n: int(n[5:]))
    right.plot(xs, series(unsplit, "attention_compute_ms_per_step"), marker="o",
               color="tab:blue", label=f"attention role compute ({unsplit})")
    right.plot(xs, series(unsplit, "ffn_compute_ms_per_step"), marker="o", color="tab:orange",
               label=f"FFN role compute ({unsplit})")
    right.plot(xs, series("colocated", "itl_p50_ms"), marker="s", color="black",
               label="colocated decode step (ITL p50)")
    right.set_ylabel("ms per decode step")
    right.set_title("where a decode step goes")
    for ax in (left, right):
        ax.set_xlim(xs[0] / 1.25, xs[-1] * 1.25)  # also when every value is missing
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(c) for c in xs])
        ax.set_xlabel("context (prompt tokens)")
        if balance is not None:
            ax.axvline(balance, color="tab:green", linestyle=":", label="roles balance")
        ax.legend(fontsize=8)
    right.set_ylim(bottom=0)
    return report.save(fig, path, title)
