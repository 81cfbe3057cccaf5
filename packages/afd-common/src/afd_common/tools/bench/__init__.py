"""``afd-bench``: colocated vLLM against AFD on the same cores, side by side in one run.

Configurations, each started alone on the same cores and stopped before the next:
``colocated_t1`` / ``colocated_t2`` (one ``vllm serve``, 1 or 2 OpenMP threads), and ``afd_m<m>``
(an attention role on the first core and an FFN role on the second, ``P2pAFDConnector``,
``num_micro_batches = m``). ``colocated`` is the faster colocated setting.

Every configuration gets the same load: a short warm-up batch, then ``repeats`` batches of
``concurrency`` streamed requests (``prompt_len`` token-id prompts, exactly ``output_len``
greedy tokens each). Definitions of the numbers are in ``afd_common.tools.bench.stats``; the AFD
per-layer breakdown comes from the roles' Prometheus ``/metrics``, scraped before and after the
measured batches.

Outputs in ``--out``: ``bench.json``, ``bench.png``, ``logs/`` (one log per server), ``model/``
(the generated checkpoint, reused by the next run with the same shape).
"""


def main(argv: list[str] | None = None) -> int:
    """The ``afd-bench`` console script (imports vLLM-free modules only until it runs)."""
    from afd_common.tools.bench.cli import main as run

    return run(argv)
