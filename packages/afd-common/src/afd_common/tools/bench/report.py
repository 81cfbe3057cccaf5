"""``afd-bench`` outputs: ``bench.json``, the table on stdout and ``bench.png``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from afd_common.tools.bench.stats import AFD_KEYS

RESULT_KEYS = ["status", "tokens_per_s", "ratio_vs_colocated", "tpot_p50_ms", "tpot_p99_ms",
               "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "output_tokens", "requests", "wall_s",
               "startup_s", *AFD_KEYS, "error"]


def empty_result(status: str = "not run", **extra) -> dict:
    return {**{k: None for k in RESULT_KEYS}, "status": status, **extra}


def write_json(path: Path, setup: dict, results: dict[str, dict]) -> Path:
    """``results`` holds colocated_t1, colocated_t2, afd_m*; ``colocated`` is derived by the
    caller. Every result has every key of RESULT_KEYS (None where not measured)."""
    doc = {"setup": setup}
    for name, result in results.items():
        doc[name] = {**empty_result(), **result}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


COLUMNS = [("config", None, 0), ("tok/s", "tokens_per_s", 1), ("vs coloc", "ratio_vs_colocated", 2),
           ("TPOT p50", "tpot_p50_ms", 1), ("TPOT p99", "tpot_p99_ms", 1),
           ("t_a", "t_a_ms", 3), ("t_e", "t_e_ms", 3), ("t_c", "t_c_ms", 3),
           ("rtt", "roundtrip_ms", 3), ("step", "t_step_ms", 1), ("eta", "eta", 2),
           ("B/step", "bytes_per_step", 0), ("imbal", "ffn_rank_imbalance", 2),
           ("start s", "startup_s", 0)]


def table(results: dict[str, dict]) -> str:
    """Rows of every configuration that ran (times in ms)."""
    rows = [[label(name, r)] + [fmt(r.get(key), d) for _, key, d in COLUMNS[1:]]
            for name, r in results.items() if r.get("status") != "not run"]
    return render([h for h, _, _ in COLUMNS], rows, 1,
                  "(times in ms; t_a/t_e/t_c per MoE layer and micro-batch)")


def label(name: str, result: dict) -> str:
    """A configuration's name in a table: which it stands for, and whether it failed."""
    return (name + (f" (= {result['source']})" if result.get("source") else "")
            + (" FAILED" if result.get("status") == "failed" else ""))


def render(header: list[str], rows: list[list[str]], left: int, note: str) -> str:
    """Columns aligned: the first ``left`` to the left (names), the rest to the right."""
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n" + note


def pyplot():
    """matplotlib's pyplot without a display, or None (and a warning) where it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed, no chart written", file=sys.stderr)
        return None
    return plt


def save(fig, path: Path, title: str = "") -> Path:
    """Title, lay out, write and close a chart."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(name: str) -> str:
    """A configuration's name on the chart: the link (afd-bench --hosts) on a line of its own."""
    return name.replace("@", "\n@")


def write_chart(path: Path, results: dict[str, dict], title: str = "") -> Path | None:
    """Left: tokens/s per configuration with the ratio to colocated on each bar. Right: one step
    of each AFD configuration per role -- the attention role's compute, time blocked on results
    and the rest; the FFN role's expert compute and idle time -- with eta."""
    plt = pyplot()
    if plt is None:
        return None

    shown = {k: v for k, v in results.items() if k != "colocated" and v.get("status") != "not run"}
    afd = {k: v for k, v in shown.items() if k.startswith("afd_")}
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(12.0, 4 + 0.8 * len(shown)), 4.8))

    names = list(shown)
    tps = [shown[n].get("tokens_per_s") or 0.0 for n in names]
    colors = ["tab:gray" if n.startswith("colocated") else "tab:blue" for n in names]
    bars = left.bar([_label(n) for n in names], tps, color=colors)
    for bar, name in zip(bars, names):
        r = shown[name]
        text = "failed" if r.get("status") == "failed" else (
            f"x{r['ratio_vs_colocated']:.2f}" if r.get("ratio_vs_colocated") is not None else "")
        left.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=9)
    left.set_ylabel("output tokens / s")
    left.set_title("throughput (ratio vs faster colocated)")
    left.tick_params(axis="x", labelrotation=30, labelsize=8 if len(names) > 6 else 10)
    left.margins(y=0.15)

    # Right: one step of each AFD configuration, as each role spent it.
    anames = list(afd)
    x = list(range(len(anames)))
    width = 0.38
    top = 0.0
    for i, name in enumerate(anames):
        r = afd[name]
        step = r.get("t_step_ms") or 0.0
        a_comp = r.get("attention_compute_ms_per_step") or 0.0
        a_wait = r.get("attention_wait_ms_per_step") or 0.0
        e_comp = r.get("ffn_compute_ms_per_step") or 0.0
        attention = [(a_comp, "tab:blue"), (a_wait, "tab:red"),
                     (max(0.0, step - a_comp - a_wait), "tab:gray")]
        ffn = [(e_comp, "tab:orange"), (max(0.0, step - e_comp), "lightgray")]
        for dx, segments in ((-width / 2, attention), (width / 2, ffn)):
            bottom = 0.0
            for value, color in segments:
                right.bar(i + dx, value, width * 0.95, bottom=bottom, color=color)
                bottom += value
        top = max(top, step)
        e = r.get("eta")
        right.annotate(f"eta {e:.2f}" if e is not None else "no metrics", (i, step),
                       ha="center", va="bottom", fontsize=9)
    best = results.get("colocated") or {}
    # A colocated decode step is its decode time per output token (one token per request per
    # step), as the AFD bars are decode steps.
    colocated_step = best.get("decode_tpot_p50_ms") or best.get("tpot_p50_ms")
    if colocated_step and anames:
        right.axhline(colocated_step, color="black", linestyle="--", linewidth=1)
        right.annotate(f"colocated decode step ({best.get('source', 'faster')}, TPOT p50)",
                       (len(anames) - 0.5, colocated_step), ha="right", va="bottom",
                       fontsize=8)
        top = max(top, colocated_step)
    right.set_xticks(x, [_label(n) for n in anames], fontsize=8 if len(anames) > 4 else 10)
    right.set_xlabel("each configuration: attention role | FFN role")
    right.set_ylabel("ms per step (one model forward)")
    right.set_title("where a step goes (per role)")
    right.set_ylim(0, top * 1.25 if top else 1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               ("tab:blue", "tab:red", "tab:gray", "tab:orange", "lightgray")]
    right.legend(handles, ["attention compute (sum t_a)", "attention blocked (sum t_c)",
                           "attention other (dense, sampling, hand-over)",
                           "FFN experts (sum t_e)", "FFN idle"],
                 fontsize=7, loc="upper left", ncol=2)
    return save(fig, path, title)
