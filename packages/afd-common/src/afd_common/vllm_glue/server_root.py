"""Which process is the root of this ``vllm serve``: the first vLLM process of a server records
its pid in the environment its children inherit. The workers use it to take the whole server
down when their AFD peer is gone (afd_common.vllm_glue.lifecycle) and to name the folder their
``/health`` status goes to (afd_common.vllm_glue.role_status)."""

from __future__ import annotations

import os

SERVER_PID_ENV = "AFD_SERVER_PID"


def mark() -> None:
    """In every vLLM process (the plugin's ``register``): the first one of a server is its
    root."""
    os.environ.setdefault(SERVER_PID_ENV, str(os.getpid()))


def pid() -> int:
    """The root's pid, 0 when not under a server afd's plugin started."""
    return int(os.environ.get(SERVER_PID_ENV, "0") or 0)
