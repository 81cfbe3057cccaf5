"""Every vLLM symbol an afd patch set replaces, named as a reader finds it in vLLM's source."""

from __future__ import annotations

import importlib
import sys
import types

from afd_common.vllm_glue.patching import PatchSet


def builders() -> dict:
    """Every patch set afd ships, by name (built, not installed)."""
    importlib.import_module("vllm.entrypoints.launchers.app")  # as in the API server process
    from afd_attention.patches import async_dp_engine, async_dp_forward_context, moe_swap
    from afd_common.vllm_glue.patches import api_server, moe_parallel, vllm_config, weight_census
    from afd_ffn.patches import prune
    return {"vllm_config": vllm_config.build, "api_server": api_server.build,
            "moe_parallel": moe_parallel.build,
            "weight_census": lambda: weight_census.build({}),
            "attention_remote_moe": moe_swap.build, "ffn_prune": prune.build,
            "async_dp_engine": async_dp_engine.build,
            "async_dp_forward_context": async_dp_forward_context.build}


def _mapping_name(mapping) -> str:
    """Where a patched registry lives: the vLLM module that defines it (the shortest name of
    those holding it)."""
    holders = sorted((len(name), f"{name}.{attr}") for name, mod in list(sys.modules.items())
                     if name.startswith("vllm") and isinstance(mod, types.ModuleType)
                     for attr, value in list(vars(mod).items()) if value is mapping)
    assert holders, "a patched mapping no vLLM module holds"
    return holders[0][1]


def symbols(patch: PatchSet) -> set[str]:
    out = set()
    for target, attr, _ in patch._attrs:
        owner = (target.__name__ if isinstance(target, types.ModuleType)
                 else f"{target.__module__}.{target.__qualname__}")
        out.add(f"{owner}.{attr}")
    for mapping, key, _ in patch._items:
        out.add(f"{_mapping_name(mapping)}[{key!r}]")
    return out
