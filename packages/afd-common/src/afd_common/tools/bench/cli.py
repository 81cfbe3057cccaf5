"""The ``afd-bench`` command line and the run of each configuration."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from afd_common.tools.bench import load, prom, report, stats, sweep
from afd_common.tools.bench.environment import (default_kv_cache_gib, describe_setup,
                                                 prepare_model, say)
from afd_common.tools.bench.hosts import Hosts
from afd_common.tools.bench.options import parse_args
from afd_common.tools.launch import Server, afd_args, free_port, wait_gone

ATTENTION_HOST, FFN_HOST = 0, 1  # --hosts: the roles' namespaces
UNLIMITED = "unlimited"  # --hosts: the namespaces' link without a cap


def host_links(args) -> list[str]:
    """--hosts: the links each AFD configuration is measured over, in order."""
    return [UNLIMITED, *args.rates]


def config_name(m: int, link: str | None = None) -> str:
    """afd_mM on loopback, afd_mM@LINK across hosts."""
    return f"afd_m{m}" if link is None else f"afd_m{m}@{link}"


class Waiting:
    """Progress while a server loads: one line rewritten in place on a terminal, else a line
    every 15 s (``Server.wait_ready`` reports every 5 s)."""

    def __init__(self):
        self.tty, self.calls = sys.stderr.isatty(), 0

    def __call__(self, msg: str) -> None:
        self.calls += 1
        if self.tty:
            print(f"\r  .. {msg}\x1b[K", end="", file=sys.stderr, flush=True)
        elif self.calls % 3 == 0:
            say(msg)

    def done(self, msg: str) -> None:
        if self.tty and self.calls:
            print("\r\x1b[K", end="", file=sys.stderr)
        say(msg)


@contextlib.contextmanager
def pinned(cores: list[int] | None):
    """Children started inside inherit this CPU affinity: the whole server (API process,
    engine core, workers) stays on ``cores``, as with ``taskset``."""
    if cores is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C / SIGTERM while servers are being stopped: finish stopping them, then raise."""
    got = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            raise KeyboardInterrupt


def stop_all(servers) -> None:
    """SIGTERM every server, give them 30 s together, then kill whatever is left."""
    with deferred_interrupts():
        for server in servers:
            server.signal()
        wait_gone(servers, 30)
        for server in servers:
            server.stop(timeout_s=1)


def _scrape(name: str, role: str, url: str) -> list[prom.Sample] | None:
    """A role's /metrics; a failed scrape is a warning (None), not a crash."""
    try:
        return prom.parse(load.scrape(url))
    except Exception as e:  # noqa: BLE001 - any failure: that batch's breakdown is left out
        print(f"warning: {name}: could not read the {role} role's /metrics: {e}",
              file=sys.stderr, flush=True)
        return None


@dataclass
class Point:
    """One load every server is measured at: a prompt length, its warm-up and its batches."""
    prompt_len: int
    warmup: list[list[int]]
    batches: list[list[list[int]]]


class Bench:
    def __init__(self, args, model: Path, tokenizer_vocab: int):
        self.args, self.model = args, str(model)
        self.started: list[Server] = []  # every server ever started, stopped again at the end
        # The same KV cache and model length everywhere, sized for the load rather than for a
        # fraction of RAM: less to allocate at start-up, room for other processes.
        self.server_args = ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)),
                            "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
        self.logs = args.out / "logs"
        a, f = args.core_list
        self.cores = {"colocated_t1": [a], "colocated_t2": [a, f], "attention": [a], "ffn": [f]}
        # A sweep warms each context up with two requests (the server is warm by then: this
        # only runs the new shapes once); a single load with a whole batch.
        warm = 2 if args.context_list else args.concurrency
        self.points = [Point(n, load.make_prompts(warm, n, tokenizer_vocab, seed=args.seed + 1000),
                             [load.make_prompts(args.concurrency, n, tokenizer_vocab,
                                                seed=args.seed + i) for i in range(args.repeats)])
                       for n in args.prompt_lens]

    def _start(self, server: Server, cores: list[int]) -> Server:
        server.cores = ",".join(map(str, cores))
        with pinned(cores if self.args.pin == "process" else None):
            server.start()
        self.started.append(server)
        return server

    def measure(self, name: str, url: str, metrics_urls: dict[str, str],
                point: Point) -> tuple[dict, dict]:
        """Warm-up, then the measured batches, each role's /metrics scraped when every request
        of a batch has its first token (the prefills are done) and when the batch is over: the
        breakdown is of decode steps only. Returns (summary, scrapes): a role's scrapes are
        every batch's (before, after) samples together, whose sums grow by the decode steps'."""
        a = self.args
        load.run_batch(url, self.model, point.warmup, a.warmup_tokens, a.request_timeout,
                       desc=f"{name} warm-up")
        before: dict[str, list] = {role: [] for role in metrics_urls}
        after: dict[str, list] = {role: [] for role in metrics_urls}
        batches = []
        for i, prompts in enumerate(point.batches):
            at_start: dict[str, list | None] = {}

            def decoding():
                for role, u in metrics_urls.items():
                    at_start[role] = _scrape(name, role, u)
            batches.append(load.run_batch(url, self.model, prompts, a.output_len,
                                          a.request_timeout, desc=f"{name} {i + 1}/"
                                          f"{len(point.batches)}", on_decoding=decoding))
            at_end = {role: _scrape(name, role, u) for role, u in metrics_urls.items()}
            # A batch counts only with both of its scrapes: one missing would count the
            # server's whole history (or a negative one) as this batch's.
            if all(at_start.get(r) is not None and at_end[r] is not None
                   for r in metrics_urls):
                for r in metrics_urls:
                    before[r] += at_start[r]
                    after[r] += at_end[r]
            else:
                print(f"warning: {name}: batch {i + 1} left out of the breakdown (a /metrics "
                      "scrape failed)", file=sys.stderr, flush=True)
        return stats.summarize(batches), {r: (before[r], after[r]) for r in metrics_urls}

    def key(self, point: Point, config: str) -> str:
        """Where a measurement goes: the configuration, at a context in a sweep."""
        return f"{point.prompt_len}/{config}" if self.args.context_list else config

    def _at_each_load(self, config: str, servers, measure_one) -> dict:
        """``measure_one(point, key)`` at every load, keyed by ``key``. A load that fails is
        that load's ConfigFailed, the others are kept; once a server has died, so is every load
        left."""
        out: dict = {}
        dead = None
        for point in self.points:
            key = self.key(point, config)
            if dead is not None:
                out[key] = dead
                continue
            try:
                out[key] = measure_one(point, key)
            except Exception as e:  # noqa: BLE001 - reported per load
                out[key] = ConfigFailed(key, e, servers)
                if any(s.exited() for s in servers):
                    dead = out[key]
        return out

    def colocated(self, names: list[str]) -> dict[str, dict]:
        """The colocated settings start together (two import chains on two cores take about
        as long as one) and are measured one after the other, each once all are ready, so no
        start-up runs beside a measurement. A failed setting does not stop the other."""
        servers = {n: Server(n, self.model, free_port(), self.logs / f"{n}.log",
                             args=self.server_args) for n in names}
        t0 = time.monotonic()
        results: dict[str, dict] = {}
        try:
            for name, server in servers.items():
                self._start(server, self.cores[name])
            waiting, startup = Waiting(), {}
            for name, server in servers.items():
                try:
                    server.wait_ready(self.args.ready_timeout, progress=waiting)
                    startup[name] = time.monotonic() - t0
                except Exception as e:  # noqa: BLE001 - reported per setting
                    results[name] = ConfigFailed(name, e, (server,))
            waiting.done(", ".join(f"{n}: ready after {t:.0f} s" for n, t in startup.items()))
            for name in startup:
                server = servers[name]

                def one(point, key, server=server, name=name):
                    # Scraped like an AFD role (the numbers unused): the same load on the
                    # server while it decodes.
                    summary, _ = self.measure(key, server.url, {"server": server.url}, point)
                    return {**summary, "startup_s": startup[name], "cores": server.cores,
                            "omp_threads": len(self.cores[name])}
                results.update(self._at_each_load(name, (server,), one))
                stop_all([server])
        finally:
            stop_all(list(servers.values()))
        return results

    def afd(self, m: int, moe_layers: int, hosts: Hosts | None = None) -> dict[str, dict]:
        """AFD with ``m`` micro-batches: on loopback (``afd_mM``), or with each role on a host
        of ``hosts`` and one measurement per link rate (``afd_mM@RATE``, "unlimited" first)."""
        a = self.args
        name = f"afd_m{m}"
        port = free_port()
        extra = {"connector": a.connector, "compute_gate_on_attention": a.gate_on_attention,
                 "num_ffn_ranks": a.ffn_ranks, "connector_extra_config": {"num_micro_batches": m}}
        placement = ["--enable-expert-parallel"] if a.sharded else []
        ffn_dp = ["--data-parallel-size", str(a.ffn_ranks)] if a.ffn_ranks > 1 else []
        where: dict[str, dict] = {"attention": {}, "ffn": {}}
        if hosts is not None:
            name += "@hosts"
            extra["host"] = hosts.address(FFN_HOST)
            for role, i in (("attention", ATTENTION_HOST), ("ffn", FFN_HOST)):
                where[role] = {"host": hosts.address(i), "wrap": hosts.wrap(i),
                               "env": hosts.env(i, data_parallel=role == "ffn"
                                                and a.ffn_ranks > 1)}
        ffn = Server(f"{name}-ffn", self.model, free_port(), self.logs / f"{name}-ffn.log",
                     args=self.server_args + afd_args("ffn", port, **extra) + ffn_dp + placement,
                     **where["ffn"])
        attention = Server(f"{name}-attention", self.model, free_port(),
                           self.logs / f"{name}-attention.log",
                           args=self.server_args + afd_args("attention", port, **extra)
                           + placement, **where["attention"])
        links = [None] if hosts is None else host_links(a)
        out = {}
        t0 = time.monotonic()
        try:
            self._start(ffn, self.cores["ffn"])
            self._start(attention, self.cores["attention"])
            waiting = Waiting()
            attention.wait_ready(a.ready_timeout, progress=waiting, others=(ffn,))
            ffn.wait_ready(a.ready_timeout, progress=waiting, others=(attention,))
            startup = time.monotonic() - t0
            waiting.done(f"{name}: both roles ready after {startup:.0f} s")
            for link in links:
                if hosts is not None:
                    hosts.cap(FFN_HOST, None if link == UNLIMITED else link)
                def one(point, key, link=link):
                    return self._afd_result(
                        key, *self.measure(key, attention.url, {"attention": attention.url,
                                                                "ffn": ffn.url}, point),
                        m, moe_layers, startup, attention, ffn, link, a.ffn_ranks)
                out.update(self._at_each_load(config_name(m, link), (attention, ffn), one))
        except Exception as e:
            raise ConfigFailed(name, e, (attention, ffn)) from e
        finally:
            stop_all([attention, ffn])
            if hosts is not None:
                hosts.cap(FFN_HOST, None)
        return out

    @staticmethod
    def _afd_result(name: str, summary: dict, scrapes: dict, m: int, moe_layers: int,
                    startup: float, attention: Server, ffn: Server, link: str | None,
                    ffn_ranks: int) -> dict:
        breakdown, missing = stats.afd_breakdown(scrapes, m, moe_layers)
        if missing:
            print(f"warning: {name}: no data for {', '.join(missing)} on /metrics; "
                  "those fields are null", file=sys.stderr, flush=True)
        if breakdown["rows_per_ffn_rank"]:
            print(f"{name}: rows per FFN rank {breakdown['rows_per_ffn_rank']}, imbalance "
                  f"(max / mean) {breakdown['ffn_rank_imbalance']:.2f}", file=sys.stderr,
                  flush=True)
        per_ffn = 1 / ffn_ranks  # afd-bench runs one attention rank
        sizing = stats.sizing_hint(breakdown["t_a_ms"], breakdown["t_e_ms"],
                                   breakdown["roundtrip_ms"], m, per_ffn)
        if sizing is not None:
            print(f"{name}: sizing hint: {stats.describe_sizing(sizing, per_ffn)}",
                  file=sys.stderr, flush=True)
        return {**summary, **breakdown, "sizing": sizing, "startup_s": startup,
                "num_micro_batches": m,
                "cores": {"attention": attention.cores, "ffn": ffn.cores}, "omp_threads": 1,
                "link": link or "loopback", "missing_metrics": missing}


class ConfigFailed(Exception):
    """A configuration that did not run: the cause, the server that says why, each log's tail."""

    def __init__(self, name: str, cause: BaseException, servers):
        reason = (str(cause).splitlines() or [""])[0]
        hints = [line.strip() for s in servers for line in s.log_tail(60).splitlines()
                 if "Error" in line or "error:" in line]
        self.summary = f"{name} failed: {type(cause).__name__}: {reason}" + (
            f" ({hints[-1][:300]})" if hints else "")
        tails = "\n".join(f"--- {s.name} log ({s.log_path}), last lines:\n{s.log_tail(25)}"
                          for s in servers)
        super().__init__(f"{self.summary}\n{tails}")
        self.name, self.cause = name, cause


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)  # stop the servers as on Ctrl-C
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    model, info = prepare_model(args)
    if args.kv_cache_gib is None:
        args.kv_cache_gib = default_kv_cache_gib(info["config"],
                                                 args.concurrency * args.max_model_len)
    moe_layers = stats.moe_layer_count(info["config"])
    vocab = info.get("tokenizer_vocab_size") or info["config"]["vocab_size"]
    bench = Bench(args, model, vocab)

    plan = ([] if args.skip_colocated else ["colocated_t1, colocated_t2"]) + \
        [f"afd_m{m}" for m in args.mb_list] + \
        ([f"afd_m{m}@hosts" for m in args.mb_list] if args.rates else [])
    hosts = None
    results: dict[str, dict] = {}
    errors: list[str] = []
    interrupted = False
    try:
        for i, name in enumerate(plan, 1):
            print(f"[{i}/{len(plan)}] {name}", file=sys.stderr, flush=True)
            if name.startswith("colocated"):
                outcomes = bench.colocated(name.split(", "))
            else:
                m, _, on_hosts = name[5:].partition("@")
                if on_hosts and hosts is None:
                    hosts = Hosts(2)
                try:
                    outcomes = bench.afd(int(m), moe_layers, hosts if on_hosts else None)
                except ConfigFailed as e:
                    outcomes = ({config_name(m, link): e for link in host_links(args)}
                                if on_hosts else {bench.key(p, name): e for p in bench.points})
            for config, outcome in outcomes.items():
                if isinstance(outcome, ConfigFailed):
                    if str(outcome) not in errors:
                        errors.append(str(outcome))
                        print(f"error: {outcome}", file=sys.stderr, flush=True)
                    results[config] = report.empty_result("failed", error=outcome.summary)
                else:
                    results[config] = {"status": "ok", **outcome}
    except KeyboardInterrupt:
        print("interrupted: servers stopped, writing what was measured", file=sys.stderr)
        interrupted = True
    finally:
        stop_all([s for s in bench.started if not s.exited() or s.pids()])
        if hosts is not None:
            hosts.close()

    print(finish(results, args, info, moe_layers, model, time.monotonic() - started))
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'} "
          f"({time.monotonic() - started:.0f} s in all)")
    if interrupted:
        return 130
    if errors:
        print(f"{len(errors)} configuration(s) failed; see the errors above", file=sys.stderr)
        return 1
    return 0


def finish(results: dict, args, info: dict, moe_layers: int, model: Path, total_s: float) -> str:
    """Ratios, the ``colocated`` pick, then bench.json and bench.png; returns the table."""
    setup = describe_setup(args, info, moe_layers, total_s, host_links(args))
    m = setup["model"]
    title = (f"{m['arch']} h{m['hidden_size']} L{m['num_layers']} E{m['num_experts']} "
             f"top{m['top_k']}, {args.concurrency} req x {args.output_len} tok, "
             f"cores {args.cores}" + ("; @RATE: roles on two hosts" if args.rates else ""))
    if args.context_list:
        doc = sweep.contexts(results, args, moe_layers)
        balance = sweep.balance_context(doc, args)
        verdicts = sweep.verdicts(doc)
        sweep.write_json(args.out / "bench.json", setup, doc, balance)
        sweep.write_chart(args.out / "bench.png", doc, balance,
                          [f"afd_m{m}" for m in args.mb_list], title)
        return "\n".join([sweep.table(doc, balance), *verdicts])
    colocated = {k: results.get(k, {}) for k in ("colocated_t1", "colocated_t2")}
    best = stats.faster({k: v for k, v in colocated.items() if v.get("status") == "ok"})
    base = best[1]["tokens_per_s"] if best else None
    for result in results.values():
        result["ratio_vs_colocated"] = stats.ratio(result.get("tokens_per_s"), base)
    ordered = {"colocated": ({**best[1], "source": best[0]} if best
                             else report.empty_result(source=None)),
               "colocated_t1": results.get("colocated_t1", report.empty_result()),
               "colocated_t2": results.get("colocated_t2", report.empty_result())}
    for m in sorted({1, 2, 3, *args.mb_list}):
        ordered[f"afd_m{m}"] = results.get(f"afd_m{m}", report.empty_result())
    for m in args.mb_list if args.rates else ():
        for link in host_links(args):
            ordered[config_name(m, link)] = results.get(config_name(m, link),
                                                        report.empty_result(link=link))
    verdict = stats.mark_split_cost({m: ordered[f"afd_m{m}"] for m in args.mb_list})
    report.write_json(args.out / "bench.json", setup, ordered)
    report.write_chart(args.out / "bench.png", ordered, title)
    return "\n".join([report.table(ordered), *([verdict] if verdict else [])])


if __name__ == "__main__":
    sys.exit(main())
