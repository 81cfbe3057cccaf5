"""Ending a whole role when its AFD peer is gone.

A role without its peer can do nothing useful: the FFN role has no one to serve, the attention
role cannot finish a single step. The worker that notices asks the server's root process (the
first vLLM process, recorded by the plugin) to shut down, which stops every process of the role;
the error is logged first so the reason is the last thing an operator reads.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from afd_common.plugin import SERVER_PID_ENV

logger = logging.getLogger("vllm.afd")
_lock = threading.Lock()
_requested = False


def shut_down_server(reason: str) -> bool:
    """Log ``reason`` and signal the server root. False when there is no separate root (e.g.
    an in-process ``LLM``), in which case the caller raises instead."""
    global _requested
    with _lock:
        if _requested:
            return True
        _requested = True
    logger.error("AFD: %s -- shutting this role down", reason)
    pid = int(os.environ.get(SERVER_PID_ENV, "0") or 0)
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True
