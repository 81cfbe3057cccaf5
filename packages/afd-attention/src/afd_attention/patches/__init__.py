"""afd_attention's changes to vLLM. Each module builds one ``PatchSet``
(afd_common.vllm_glue.patching).

``on_vllm_config`` is this package's hook into the process that builds the vLLM config (its
``RolePlugin``, afd_attention.role, called by
``afd_common.vllm_glue.patches.vllm_config`` after it checked the platform): it installs the async-DP engine patch where async DP is on.
"""

from __future__ import annotations

from afd_common.config import AFDConfig


def async_dp_enabled(afd: AFDConfig) -> bool:
    """The async-DP patches apply to the attention role with ``async_dp`` (the platform check --
    NPU, or CPU with ``ops_backend = "portable"`` -- is done with the rest of the config)."""
    return afd.is_attention and afd.async_dp


def on_vllm_config(vllm_config, afd: AFDConfig) -> None:
    if async_dp_enabled(afd):
        from afd_attention.patches import async_dp_engine

        async_dp_engine.patch_set().install()
