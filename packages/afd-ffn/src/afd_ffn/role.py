"""The FFN role's registration with afd_common (entry point ``afd.roles``: ``ffn``)."""

from __future__ import annotations

from afd_common.registry import RolePlugin

ROLE = RolePlugin(
    role="ffn",
    workers={"cpu": "afd_ffn.cpu_worker.AFDFFNCPUWorker",
             "cuda": "afd_ffn.gpu_worker.AFDFFNGPUWorker"},
)
