"""The colocated reference answers, from vLLM's offline engine: one process serves every
checkpoint in turn.

A `vllm serve` per checkpoint would pay vLLM's imports three times over (API server, engine core,
worker) for each of them; here they are paid once and each further checkpoint costs only its
engine start. The engine, its flags and the scheduling of prompts submitted together are the same
as the server's, so the answers are the ones a colocated `vllm serve` gives (the AFD servers are
compared with them token for token).

Usage: ``python colocated_reference.py JOBS_JSON OUT_JSON``; a job is
``{"key": ..., "model": ..., "prompts": [...], "max_tokens": [...]}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys

# The engine in this process, not a child (what saves the imports).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def engine_kwargs(common_args: list[str]) -> dict:
    """``launch.COMMON_ARGS`` (``--flag value`` pairs and bare flags) as ``LLM`` keywords."""
    out, i = {}, 0
    while i < len(common_args):
        key = common_args[i].lstrip("-").replace("-", "_")
        if i + 1 < len(common_args) and not common_args[i + 1].startswith("--"):
            value = common_args[i + 1]
            out[key] = int(value) if value.isdigit() else value
            i += 2
        else:
            out[key] = True
            i += 1
    out.pop("api_server_count", None)  # a server flag
    return out


def main(jobs_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from afd_common.tools.launch import COMMON_ARGS, cpu_backend_args

    kwargs = engine_kwargs(COMMON_ARGS)
    results = {}
    for job in json.loads(open(jobs_path).read()):
        llm = LLM(job["model"], **kwargs,
                  **engine_kwargs(cpu_backend_args(job["model"])))
        params = [SamplingParams(temperature=0, max_tokens=n, logprobs=1, ignore_eos=True, seed=0)
                  for n in job["max_tokens"]]
        outs = llm.generate(job["prompts"], params, use_tqdm=False)
        results[job["key"]] = [
            {"tokens": [f"token_id:{t}" for t in o.outputs[0].token_ids],
             "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                          o.outputs[0].logprobs)]}
            for o in outs]
        del llm
        gc.collect()
        print(f"colocated reference: {job['key']} done", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
