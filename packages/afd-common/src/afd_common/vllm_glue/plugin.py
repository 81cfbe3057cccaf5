"""vLLM general-plugin entry point (``vllm.general_plugins``: ``afd``).

vLLM calls ``register()`` once in every process it starts (API server, engine core, workers; CPU
spawns: only the environment is inherited). It installs afd_common's patch sets, which act only on
configs that carry an ``afd`` section: a vLLM without ``--additional-config '{"afd": ...}'``
behaves as if afd were not installed. Role-specific patches are installed by the role's worker. A
process an AFD server started also ends the way its root does (``lifecycle.inherit_quick_exit``).
"""

from __future__ import annotations

from afd_common.vllm_glue import lifecycle, server_root
from afd_common.vllm_glue.patching import PatchSet

_installed: list[PatchSet] = []


def register() -> None:
    server_root.mark()
    lifecycle.inherit_quick_exit()
    if _installed:
        return
    from afd_common import redaction
    from afd_common.vllm_glue.patches import api_server, vllm_config

    redaction.install()
    for build in (vllm_config.build, api_server.build):
        patch = build()
        if patch is not None:
            patch.install()
            _installed.append(patch)
