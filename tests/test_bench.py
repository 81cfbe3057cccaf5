"""afd-bench without servers: the Prometheus reader, the statistics, bench.json and the chart."""

from __future__ import annotations

import json

import pytest

from afd_common.tools.bench import prom, report, stats, sweep
from afd_common.tools.bench.options import parse_args, parse_cores
from afd_common.tools.bench.load import make_prompts
from afd_common.tools.bench.stats import RequestTiming

EXPOSITION = """\
# HELP afd_wait_seconds Time blocked waiting for a result.
# TYPE afd_wait_seconds histogram
afd_wait_seconds_bucket{connector="P2pAFDConnector",le="0.001",role="attention"} 2.0
afd_wait_seconds_bucket{connector="P2pAFDConnector",le="+Inf",role="attention"} 4.0
afd_wait_seconds_sum{connector="P2pAFDConnector",role="attention"} 0.004
afd_wait_seconds_count{connector="P2pAFDConnector",role="attention"} 4.0
afd_wait_seconds_sum{connector="P2pAFDConnector",pid="11",role="ffn"} 0.5
afd_wait_seconds_sum{connector="P2pAFDConnector",pid="12",role="ffn"} 0.25
afd_wait_seconds_count{connector="P2pAFDConnector",pid="11",role="ffn"} 10
afd_wait_seconds_count{connector="P2pAFDConnector",pid="12",role="ffn"} 5
afd_bytes_total{connector="P2pAFDConnector",direction="sent",role="attention"} 1.5e+03 1712345678
weird_label{path="a\\"b}c",other="x\\\\y"} 7
no_labels 3
nan_metric{role="x"} NaN
"""


def test_parse_reads_names_labels_values_and_refuses_junk():
    samples = prom.parse(EXPOSITION)
    weird = next(s for s in samples if s.name == "weird_label")
    assert weird.labels == {"path": 'a"b}c', "other": "x\\y"} and weird.value == 7
    assert next(s for s in samples if s.name == "no_labels").labels == {}
    inf = [s for s in samples if s.labels.get("le") == "+Inf"]
    assert inf[0].value == 4.0
    # a trailing timestamp is not the value
    assert prom.total(samples, "afd_bytes_total", direction="sent") == 1500.0
    with pytest.raises(ValueError):
        prom.parse(EXPOSITION + "broken{oops} 1\n")


def test_total_sums_matching_samples_over_processes():
    samples = prom.parse(EXPOSITION)
    assert prom.total(samples, "afd_wait_seconds_sum", role="ffn") == pytest.approx(0.75)
    assert prom.total(samples, "afd_wait_seconds_count", role="ffn") == 15
    assert prom.total(samples, "afd_wait_seconds_count") == 19  # every role
    assert prom.total(samples, "afd_wait_seconds_count", role="nobody") is None
    assert prom.total(samples, "missing_metric") is None
    assert prom.total(samples, "nan_metric") is None


def test_histogram_mean_from_deltas():
    before = prom.parse(EXPOSITION)
    after_text = EXPOSITION.replace('role="attention"} 0.004', 'role="attention"} 0.010') \
        .replace('afd_wait_seconds_count{connector="P2pAFDConnector",role="attention"} 4.0',
                 'afd_wait_seconds_count{connector="P2pAFDConnector",role="attention"} 7.0')
    after = prom.parse(after_text)
    assert prom.mean_ms(before, after, "afd_wait_seconds", role="attention") == \
        pytest.approx(2.0)  # 6 ms over 3 observations
    assert prom.mean_ms(before, before, "afd_wait_seconds", role="attention") is None  # no count
    assert prom.mean_ms(before, after, "afd_missing_seconds", role="attention") is None
    # a series that appears between the scrapes counts from zero
    assert prom.delta([], after, "afd_wait_seconds_count", role="ffn") == 15


def test_percentile_interpolates_and_handles_empty():
    assert stats.percentile([], 50) is None
    assert stats.percentile([5.0], 99) == 5.0
    assert stats.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert stats.percentile([4, 1, 3, 2], 0) == 1 and stats.percentile([4, 1, 3, 2], 100) == 4
    assert stats.percentile(list(range(101)), 99) == pytest.approx(99)


def test_request_timing_and_summary():
    # 4 tokens: arrivals at 1.0 (1 token), 1.1 (1), 1.3 (2 tokens in one chunk)
    a = RequestTiming(t_send=0.5, t_end=1.35, arrivals=[(1.0, 1), (1.1, 1), (1.3, 2)])
    assert a.tokens == 4 and a.ttft_s == pytest.approx(0.5)
    assert a.tpot_s == pytest.approx(0.3 / 3)
    assert a.gaps_s() == pytest.approx([0.1, 0.1, 0.1])
    b = RequestTiming(t_send=0.5, t_end=2.0, arrivals=[(1.0, 1), (2.0, 1)])
    assert b.tpot_s == pytest.approx(1.0)
    assert RequestTiming(0, 1, [(0.5, 1)]).tpot_s is None
    s = stats.summarize([(2.0, [a, b])])
    assert s["tokens_per_s"] == pytest.approx(3.0) and s["output_tokens"] == 6
    assert s["tpot_p50_ms"] == pytest.approx((100 + 1000) / 2)
    assert s["tpot_p99_ms"] == pytest.approx(100 + 900 * 0.99)
    two = stats.summarize([(2.0, [a]), (1.0, [b])])
    assert two["tokens_per_s"] == pytest.approx(6 / 3.0) and two["requests"] == 2


def test_faster_ratio_and_eta():
    results = {"colocated_t1": {"tokens_per_s": 50.0}, "colocated_t2": {"tokens_per_s": 80.0},
               "broken": {"tokens_per_s": None}}
    assert stats.faster(results)[0] == "colocated_t2"
    assert stats.faster({"x": {"tokens_per_s": None}}) is None
    assert stats.ratio(40.0, 80.0) == 0.5
    assert stats.ratio(None, 80.0) is None and stats.ratio(40.0, None) is None
    assert stats.eta(2, 8, 1.0, 1.5, 30.0) == pytest.approx(2 * 8 * 1.5 / 30)
    assert stats.eta(1, 8, None, 1.5, 30.0) is None and stats.eta(1, 8, 1, 1, 0) is None


def test_moe_layer_count():
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 8, "num_experts": 16,
            "mlp_only_layers": [0, 5], "decoder_sparse_step": 1}
    assert stats.moe_layer_count(qwen) == 6
    assert stats.moe_layer_count({**qwen, "mlp_only_layers": [], "decoder_sparse_step": 2}) == 4
    ds = {"model_type": "deepseek_v2", "num_hidden_layers": 8, "n_routed_experts": 16,
          "first_k_dense_replace": 1, "moe_layer_freq": 1}
    assert stats.moe_layer_count(ds) == 7
    with pytest.raises(ValueError):
        stats.moe_layer_count({"model_type": "llama", "num_hidden_layers": 2})


def _scrape(values: dict[str, float]) -> list[prom.Sample]:
    out = []
    for key, value in values.items():
        name, _, rest = key.partition("|")
        labels = dict(kv.split("=") for kv in rest.split(",")) if rest else {}
        out.append(prom.Sample(name, {"connector": "P2pAFDConnector", **labels}, value))
    return out


def test_afd_breakdown_from_scrapes_and_missing_series():
    att_before = _scrape({"afd_step_seconds_count|role=attention": 10,
                          "afd_step_seconds_sum|role=attention": 1.0})
    att_after = _scrape({
        "afd_step_seconds_count|role=attention": 20, "afd_step_seconds_sum|role=attention": 1.5,
        "afd_attention_compute_seconds_count|role=attention": 160,
        "afd_attention_compute_seconds_sum|role=attention": 0.16,
        "afd_wait_seconds_count|role=attention": 160, "afd_wait_seconds_sum|role=attention": 0.32,
        "afd_layer_roundtrip_seconds_count|role=attention": 160,
        "afd_layer_roundtrip_seconds_sum|role=attention": 0.4,
        "afd_bytes_total|role=attention,direction=sent": 1000,
        "afd_bytes_total|role=attention,direction=received": 3000})
    ffn_after = _scrape({"afd_ffn_compute_seconds_count|role=ffn": 160,
                         "afd_ffn_compute_seconds_sum|role=ffn": 0.24,
                         "afd_wait_seconds_count|role=ffn": 160,
                         "afd_wait_seconds_sum|role=ffn": 0.08})
    out, missing = stats.afd_breakdown({"attention": (att_before, att_after),
                                        "ffn": ([], ffn_after)}, m=2, moe_layers=8)
    assert missing == []
    assert out["t_step_ms"] == pytest.approx(50.0) and out["steps"] == 10
    assert out["t_a_ms"] == pytest.approx(1.0) and out["t_c_ms"] == pytest.approx(2.0)
    assert out["roundtrip_ms"] == pytest.approx(2.5)
    assert out["t_e_ms"] == pytest.approx(1.5) and out["ffn_wait_ms"] == pytest.approx(0.5)
    assert out["bytes_per_step"] == pytest.approx(400.0)
    assert out["eta"] == pytest.approx(2 * 8 * 1.5 / 50.0)

    none, missing = stats.afd_breakdown({"attention": ([], []), "ffn": ([], [])}, 1, 8)
    assert all(none[k] is None for k in stats.AFD_KEYS) and len(missing) == 8
    assert none["rows_per_ffn_rank"] == [] and none["ffn_rank_imbalance"] is None


def test_ffn_rank_imbalance_is_max_over_mean_of_the_window():
    before = _scrape({"afd_routed_rows_total|role=ffn,ffn_rank=0": 100,
                      "afd_routed_rows_total|role=ffn,ffn_rank=1": 50})
    after = _scrape({"afd_routed_rows_total|role=ffn,ffn_rank=0": 400,
                     "afd_routed_rows_total|role=ffn,ffn_rank=1": 150,
                     "afd_routed_rows_total|role=ffn,ffn_rank=2": 200})
    rows, imbalance = stats.ffn_rank_load(before, after)
    assert rows == [300, 100, 200] and imbalance == pytest.approx(1.5)


def _fake_results() -> dict:
    ok = {"status": "ok", "tokens_per_s": 100.0, "tpot_p50_ms": 40.0, "tpot_p99_ms": 45.0}
    return {
        "colocated": {**ok, "source": "colocated_t2", "ratio_vs_colocated": 1.0},
        "colocated_t1": {**ok, "tokens_per_s": 70.0, "ratio_vs_colocated": 0.7},
        "colocated_t2": {**ok, "ratio_vs_colocated": 1.0},
        "afd_m1": {**ok, "tokens_per_s": 90.0, "ratio_vs_colocated": 0.9, "t_a_ms": 1.0,
                   "t_e_ms": 1.2, "t_c_ms": 1.5, "eta": 0.6},
        "afd_m2": report.empty_result("failed", error="afd_m2 failed: boom"),
        "afd_m3": {**ok, "tokens_per_s": 95.0, "ratio_vs_colocated": 0.95},  # no metrics
    }


def test_bench_json_schema(tmp_path):
    path = report.write_json(tmp_path / "o" / "bench.json", {"model": {"arch": "qwen3_moe"}},
                             _fake_results())
    doc = json.loads(path.read_text())
    assert {"setup", "colocated", "colocated_t1", "colocated_t2", "afd_m1", "afd_m2",
            "afd_m3"} <= set(doc)
    required = {"tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "t_a_ms", "t_e_ms", "t_c_ms",
                "eta", "ratio_vs_colocated"}
    for key in ("colocated", "colocated_t1", "colocated_t2", "afd_m1", "afd_m2", "afd_m3"):
        assert required <= set(doc[key]), key
    assert doc["afd_m3"]["t_a_ms"] is None and doc["afd_m2"]["status"] == "failed"
    assert doc["colocated"]["source"] == "colocated_t2"


def test_table_lists_configs_and_marks_failures():
    text = report.table(_fake_results())
    assert "colocated (= colocated_t2)" in text and "afd_m2 FAILED" in text
    assert "0.90" in text and "tok/s" in text


def test_chart_writes_a_png(tmp_path):
    path = report.write_chart(tmp_path / "bench.png", _fake_results(), "fake")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_defaults_and_validation():
    quick = parse_args(["--quick", "--micro-batches", "2,1,2"])
    assert (quick.concurrency, quick.output_len, quick.repeats) == (8, 32, 1)
    assert quick.mb_list == [1, 2] and quick.core_list == [0, 1]
    full = parse_args(["--concurrency", "3"])
    assert (full.concurrency, full.output_len) == (3, 64) and full.mb_list == [1, 2, 3]
    assert parse_cores("2-3") == [2, 3] and parse_cores("0,5") == [0, 5]
    # The model length follows the load, 512 at the least; the KV cache, once the model is
    # known (test_the_kv_cache_follows_the_model_and_the_load).
    assert (full.max_model_len, full.kv_cache_gib, full.prompt_len) == (512, None, 16)
    long = parse_args(["--prompt-len", "1000", "--output-len", "100", "--concurrency", "16"])
    assert long.max_model_len == 1100
    assert parse_args(["--prompt-len", "1000", "--kv-cache-gib", "3"]).kv_cache_gib == 3
    sweep = parse_args(["--preset", "sweep"])
    assert (sweep.concurrency, sweep.output_len, sweep.repeats) == (8, 64, 2)
    assert sweep.context_list == sweep.prompt_lens == [128, 512, 1024, 2048]
    assert sweep.max_model_len == 2048 + 64 and full.context_list == [] and full.prompt_lens == [16]
    assert parse_args(["--preset", "sweep", "--contexts", "64,32,64"]).context_list == [32, 64]
    for bad in (["--cores", "0"], ["--cores", "1,1"], ["--micro-batches", "0"],
                ["--micro-batches", "x"], ["--preset", "sweep", "--contexts", "0"],
                ["--preset", "sweep", "--contexts", "a"], ["--preset", "long"],
                ["--preset", "sweep", "--hosts", "1gbit"], ["--kv-cache-gib", "0"],
                ["--contexts", "128"], ["--preset", "sweep", "--prompt-len", "64"],
                ["--micro-batches", ","]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_split_verdict_says_what_micro_batches_cost_each_role_and_which_m_won():
    def entry(attn, ffn, ratio, status="ok"):
        return {"status": status, "attention_compute_ms_per_step": attn,
                "ffn_compute_ms_per_step": ffn, "ratio_vs_colocated": ratio}
    costs, line = stats.split_verdict({1: entry(40.0, 50.0, 0.6), 2: entry(50.0, 55.0, 0.7),
                                       3: entry(60.0, 75.0, 0.65)}, "ratio_vs_colocated")
    assert costs == {2: pytest.approx({"attention": 0.25, "ffn": 0.10}),
                     3: pytest.approx({"attention": 0.5, "ffn": 0.5})}
    assert line == ("split cost (compute per step against m = 1): m = 2 attention +25% / FFN "
                    "+10%, m = 3 attention +50% / FFN +50%; fastest measured: m = 2 (0.70x "
                    "colocated)")
    # A failed run is no measurement; one m alone has nothing to compare.
    assert stats.split_verdict({1: entry(40.0, 50.0, 0.6), 2: entry(None, None, None, "failed")},
                               "ratio_vs_colocated") is None


def test_every_server_gets_the_same_dtype():
    from afd_common.tools.bench.cli import Bench

    for argv, dtype in ((["--kv-cache-gib", "1"], "float32"),
                        (["--kv-cache-gib", "1", "--dtype", "bfloat16"], "bfloat16")):
        args = Bench(parse_args(argv), "model", 100).server_args
        assert args[args.index("--dtype") + 1] == dtype
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float16"])


def test_hosts_rates_are_read_as_tc_writes_them_and_bad_ones_named(capsys):
    args = parse_args(["--hosts", "100mbit, 1Gbit"])
    assert args.rates == ["100mbit", "1gbit"] and parse_args([]).rates == []
    for bad, named in (("fast", "'fast'"), ("", "at least one rate")):
        with pytest.raises(SystemExit):
            parse_args(["--hosts", bad])
        err = capsys.readouterr().err
        assert "--hosts" in err and named in err, err


def test_prompts_are_fixed_and_in_range():
    a = make_prompts(4, 16, 300, seed=1)
    assert a == make_prompts(4, 16, 300, seed=1) != make_prompts(4, 16, 300, seed=2)
    assert all(len(p) == 16 and all(16 <= t < 300 for t in p) for p in a)


def test_sizing_hint_picks_the_smallest_m_that_hides_the_transfers_and_the_balancing_ratio():
    # m = 1: a layer computes for max(2, 1) = 2 ms; the round trip is 1.5 ms, 1 of it FFN
    # compute, so 0.5 ms of transfer: 2 * 0.5 <= (k - 2) * 2 / k first holds at k = 4.
    hint = stats.sizing_hint(2.0, 1.0, 1.5, 1, 1.0)
    assert hint["best_m"] == 4 and hint["transfer_ms"] == pytest.approx(0.5)
    assert hint["layer_compute_ms"] == pytest.approx(2.0)
    # The attention rank is twice as busy as the FFN rank serving it: 2 attention ranks per FFN
    # rank would balance them; measured with 2 FFN ranks (1:2), 1:1 would.
    assert hint["balanced_attention_per_ffn"] == pytest.approx(2.0)
    assert stats.sizing_hint(2.0, 1.0, 1.5, 1, 0.5)["balanced_attention_per_ffn"] == 1.0
    # Measured at m = 2, each micro-batch is half the layer's work: the same layer, same hint.
    assert stats.sizing_hint(1.0, 0.5, 1.0, 2, 1.0)["best_m"] == 4
    # No transfer cost: two micro-batches already overlap the roles.
    assert stats.sizing_hint(2.0, 1.0, 1.0, 1, 1.0)["best_m"] == 2
    # A transfer of half the compute or more: no m hides it, and the text says what to do.
    hint = stats.sizing_hint(2.0, 1.0, 2.0, 1, 1.0)
    assert hint["best_m"] is None
    assert "no m up to 8" in stats.describe_sizing(hint, 1.0)
    assert "m = 4 hides" in stats.describe_sizing(stats.sizing_hint(2.0, 1.0, 1.5, 1, 1.0), 1.0)
    # Without the times (a metric missing on /metrics) there is no hint.
    assert stats.sizing_hint(None, 1.0, 1.5, 1, 1.0) is None
    assert stats.sizing_hint(2.0, 0.0, 1.5, 1, 1.0) is None


def test_decode_is_measured_only_where_every_request_decodes():
    # b's prefill ends at 1.15 (its first token), a finishes at 1.4: the window is (1.15, 1.4].
    a = RequestTiming(0.0, 1.45, [(1.0, 1), (1.1, 1), (1.2, 1), (1.3, 1), (1.4, 1)])
    b = RequestTiming(0.0, 1.6, [(1.15, 1), (1.25, 1), (1.35, 1), (1.45, 1), (1.55, 1)])
    assert stats.decode_window([a, b]) == pytest.approx((1.15, 1.4))
    s = stats.decode_summary([(1.6, [a, b])])
    # 3 of a's tokens and 2 of b's arrive in the 0.25 s window (b's first one ends its prefill).
    assert s["decode_tokens_per_s"] == pytest.approx(5 / 0.25)
    assert s["decode_window_s"] == pytest.approx(0.25)
    assert s["decode_tpot_p50_ms"] == pytest.approx(100)
    assert s["decode_itl_p50_ms"] == pytest.approx(100)
    # The 0.5 s wait for a's first token (a prefill) is in the end-to-end numbers only.
    assert stats.summarize([(1.6, [a, b])])["decode_tokens_per_s"] == pytest.approx(20)
    assert stats.summarize([(1.6, [a, b])])["tokens_per_s"] == pytest.approx(10 / 1.6)
    # One request done before another's prefill ended: no window, no decode numbers.
    late = RequestTiming(0.0, 3.0, [(2.0, 1), (2.5, 1)])
    assert stats.decode_window([a, late]) is None
    assert stats.decode_summary([(3.0, [a, late])])["decode_tokens_per_s"] is None


def _sweep_results() -> dict:
    """Two contexts: at 128 the FFN role's compute dominates, at 1024 the roles balance."""
    def run(tps, itl, **afd):
        return {"status": "ok", "decode_tokens_per_s": tps, "decode_itl_p50_ms": itl,
                "decode_itl_p99_ms": itl * 1.5, "decode_tpot_p50_ms": itl,
                "decode_tpot_p99_ms": itl * 1.2, "tpot_p50_ms": 999.0, "ttft_p50_ms": 500.0,
                "tokens_per_s": tps / 2, **afd}
    out = {}
    for c, attn, ffn in ((128, 10.0, 30.0), (1024, 40.0, 42.0)):
        out[f"{c}/colocated_t1"] = run(100.0, 80.0)
        out[f"{c}/colocated_t2"] = run(200.0, 40.0)
        out[f"{c}/afd_m1"] = run(150.0, 53.0, t_a_ms=attn / 8, t_e_ms=ffn / 8, t_step_ms=50.0,
                                 attention_compute_ms_per_step=attn,
                                 ffn_compute_ms_per_step=ffn)
    out["1024/afd_m2"] = report.empty_result("failed", error="afd_m2 failed: boom")
    return out


def test_sweep_entries_are_decode_only_with_ratios_ideal_and_the_balance(tmp_path):
    args = parse_args(["--preset", "sweep", "--contexts", "128,1024", "--micro-batches", "1,2"])
    doc = sweep.contexts(_sweep_results(), args, moe_layers=8)
    assert list(doc) == ["128", "1024"]
    at = doc["1024"]
    assert at["colocated"]["source"] == "colocated_t2"
    m1 = at["afd_m1"]
    assert m1["ratio_vs_colocated"] == pytest.approx(0.75)
    # tpot/itl are the decode ones, not the end-to-end TPOT that holds the prefill.
    assert m1["tpot_p50_ms"] == 53.0 and m1["itl_p99_ms"] == pytest.approx(79.5)
    # Ideal: 1 * 8 * max(5, 5.25) = 42 ms of overlapped compute + 3 ms outside the forward
    # (a 53 ms decode step, 50 of it the forward); 8 requests per step.
    assert m1["ideal_step_ms"] == pytest.approx(45.0)
    assert m1["ideal_ratio_vs_colocated"] == pytest.approx(8 * 1000 / 45.0 / 200.0)
    assert at["afd_m2"]["status"] == "failed" and at["afd_m2"]["ratio_vs_colocated"] is None
    assert doc["128"]["afd_m2"]["status"] == "not run"
    required = {"decode_tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms"}
    afd_required = required | {"t_a_ms", "t_e_ms", "t_c_ms", "eta", "ideal_step_ms",
                               "ratio_vs_colocated"}
    for entries in doc.values():
        for name, entry in entries.items():
            assert (afd_required if name.startswith("afd") else required) <= set(entry), name
    balance = sweep.balance_context(doc, args)
    assert balance == 1024
    path = sweep.write_json(tmp_path / "bench.json", {"model": {}}, doc, balance)
    written = json.loads(path.read_text())
    assert written["balance_context"] == 1024 and set(written["contexts"]) == {"128", "1024"}
    text = sweep.table(doc, balance)
    assert "1024 <- balance" in text and "afd_m2 FAILED" in text and "0.75" in text
    png = sweep.write_chart(tmp_path / "bench.png", doc, balance, ["afd_m1", "afd_m2"], "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ideal_step_and_balance_context():
    assert stats.ideal_step_ms(2, 4, 1.0, 3.0, 30.0, 35.0) == pytest.approx(2 * 4 * 3 + 5)
    # A forward longer than the measured step (noise) adds nothing outside it.
    assert stats.ideal_step_ms(1, 4, 1.0, 3.0, 30.0, 29.0) == pytest.approx(12.0)
    assert stats.ideal_step_ms(1, 4, None, 3.0, 30.0, 29.0) is None
    # Closest in ratio, not in difference: 10 vs 20 is further apart than 100 vs 150.
    assert stats.balance_context({128: (10.0, 20.0), 2048: (150.0, 100.0)}) == 2048
    assert stats.balance_context({128: (None, 20.0)}) is None


def test_a_batch_calls_back_once_every_request_decodes():
    """run_batch's on_decoding: once, after every request's first token, before the last."""
    import http.server
    import threading
    import time

    from afd_common.tools.bench.load import run_batch

    class Stream(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            delay = 0.05 * body["prompt"][0]  # a longer prefill for the second request
            self.send_response(200)
            self.end_headers()
            for i in range(body["max_tokens"]):
                time.sleep(delay if i == 0 else 0.05)
                chunk = {"choices": [{"token_ids": [i]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    called = []
    try:
        wall, timings = run_batch(f"http://127.0.0.1:{server.server_port}", "m", [[1], [4]], 6,
                                  on_decoding=lambda: called.append(time.perf_counter()))
    finally:
        server.shutdown()
    firsts = [t.arrivals[0][0] for t in timings]
    assert len(called) == 1 and max(firsts) <= called[0] < min(t.t_end for t in timings)


def test_a_checkpoint_too_short_for_the_load_is_refused_before_any_server(tmp_path):
    from afd_common.tools.bench.environment import prepare_model

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    args = parse_args(["--model", str(tmp_path), "--preset", "sweep", "--contexts", "1024"])
    with pytest.raises(SystemExit, match="at most 1024 positions .* --max-model-len 1088"):
        prepare_model(args)
    args = parse_args(["--model", str(tmp_path), "--preset", "sweep", "--contexts", "512"])
    assert prepare_model(args)[1]["config"]["max_position_embeddings"] == 1024


def test_the_kv_cache_follows_the_model_and_the_load():
    from afd_common.tools.bench.environment import default_kv_cache_gib, kv_bytes_per_token

    # The generated model: 8 layers x (K and V) x 4 KV heads x 128 x float32 = 32 KiB a token.
    qwen = {"num_hidden_layers": 8, "num_key_value_heads": 4, "head_dim": 128,
            "num_attention_heads": 8, "hidden_size": 1024}
    assert kv_bytes_per_token(qwen) == 32 * 2**10
    # MLA keeps one latent and the rope key per layer.
    assert kv_bytes_per_token({"num_hidden_layers": 2, "kv_lora_rank": 64,
                               "qk_rope_head_dim": 32}) == 2 * 96 * 4
    # Without head_dim: hidden / heads; without KV heads: every head.
    assert kv_bytes_per_token({"num_hidden_layers": 1, "num_attention_heads": 4,
                               "hidden_size": 64}) == 2 * 4 * 16 * 4
    assert kv_bytes_per_token({"hidden_size": 64}) is None
    assert default_kv_cache_gib(qwen, 8 * 2112) == pytest.approx(1.25 * 8 * 2112 / 2**15)
    assert default_kv_cache_gib(qwen, 100) == 0.5
    assert default_kv_cache_gib({}, 2**14) == pytest.approx(1.25)  # 64 KiB a token


def test_a_batch_whose_scrape_failed_is_left_out_of_the_breakdown(monkeypatch, tmp_path):
    """Scrapes of several batches add up; one failed scrape would count the server's whole
    history as its batch's, so that batch is left out and the others still count."""
    from afd_common.tools.bench import cli

    args = parse_args(["--quick", "--repeats", "3", "--out", str(tmp_path)])
    args.kv_cache_gib = 0.5
    bench = cli.Bench(args, tmp_path, 300)

    def run_batch(url, model, prompts, tokens, timeout, desc="", on_decoding=None):
        if on_decoding is not None:
            on_decoding()
        return 1.0, []
    # The counter grows by 10 per batch during decode and 1000 between batches (prefill).
    counts = iter([1000, 1010, 2010, None, 3010, 3020])
    scrapes = []

    def scrape(name, role, url):
        value = next(counts)
        scrapes.append(value)
        return None if value is None else prom.parse(
            f'afd_step_seconds_count{{role="attention"}} {value}\n')
    monkeypatch.setattr(cli.load, "run_batch", run_batch)
    monkeypatch.setattr(cli, "_scrape", scrape)
    _, got = bench.measure("t", "http://x", {"attention": "http://x"}, bench.points[0])
    before, after = got["attention"]
    assert len(scrapes) == 6
    assert prom.delta(before, after, "afd_step_seconds_count", role="attention") == 20
