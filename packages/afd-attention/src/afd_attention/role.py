"""The attention role's registration with afd_common (entry point ``afd.roles``: ``attention``)."""

from __future__ import annotations

from afd_common.registry import RolePlugin

from afd_attention.patches import on_vllm_config

ROLE = RolePlugin(
    role="attention",
    workers={"cpu": "afd_attention.cpu_worker.AFDAttentionCPUWorker",
             "cuda": "afd_attention.gpu_worker.AFDAttentionGPUWorker"},
    on_vllm_config=on_vllm_config,
)
