"""Async DP for the attention role: every DP rank is an independent, plain engine core.

vLLM runs a data-parallel MoE model as DP engine cores in lock-step "waves": an idle rank runs
dummy batches and all ranks all-reduce every step, so the expert layers can all-to-all. With
``CAMAsyncAFDConnector`` the experts live on the FFN role, which serves whichever attention rank
is ready, so the attention role needs no lock-step: its DP ranks are independent, like vLLM's DP
for dense models. While installed, the attention model is not an MoE model *for vLLM's engine and
DP decisions* (``ModelConfig.is_moe`` is False): plain ``EngineCoreProc`` per rank, no wave
coordination in the DP coordinator, no DP metadata in the forward context (``is_moe_model``).

Engine cores are spawned processes that decide their kind before vLLM loads plugins, so the patch
set also wraps ``EngineCoreProc.run_engine_core``: the wrapper installs this patch set in the
new process first. Installed by ``afd_attention.patches.on_vllm_config`` in the process that
builds the config, only for the attention role with ``async_dp`` (and there only on NPU or with
``ops_backend = "portable"``).
"""

from __future__ import annotations

from afd_common.vllm_glue.patching import PatchSet

from vllm.v1.engine.core import EngineCoreProc

# vLLM's own entry, taken when this module is first imported (before any patching).
_VLLM_RUN_ENGINE_CORE = EngineCoreProc.__dict__["run_engine_core"].__func__
_patch: PatchSet | None = None


def _is_moe(self) -> bool:
    return False


def run_engine_core(*args, **kwargs):
    """vLLM's engine-core entry, in a process that first installs async DP (spawned engine
    cores do not inherit the parent's patches)."""
    patch_set().install()
    return _VLLM_RUN_ENGINE_CORE(*args, **kwargs)


def build() -> PatchSet:
    from vllm.config.model import ModelConfig

    return (PatchSet("async_dp_engine")
            .setattr(ModelConfig, "is_moe", property(_is_moe))
            .setattr(EngineCoreProc, "run_engine_core", staticmethod(run_engine_core)))


def patch_set() -> PatchSet:
    """The one instance of this process (installing twice is a no-op)."""
    global _patch
    if _patch is None:
        _patch = build()
    return _patch
