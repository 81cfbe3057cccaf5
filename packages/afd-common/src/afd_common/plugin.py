"""vLLM general-plugin entry point (``vllm.general_plugins``: ``afd``).

vLLM calls ``register()`` once in every process it starts (API server, engine core, workers).
"""

from __future__ import annotations


def register() -> None:
    """Nothing to install until a role is configured; see the vLLM integration."""
