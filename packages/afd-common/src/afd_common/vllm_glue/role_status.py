"""What the workers tell their server's ``/health``: a small file per rank, never a call.

The FFN role's ranks publish their serving loop's state (starting, waiting for an attention
role, serving, failed); an attention rank publishes only while it waits for an FFN role to come
back. Asking the workers on every probe instead (vLLM's ``collective_rpc``) wakes them: vLLM's
shared-memory queue reader spins for a second after each message, and a prober polling twice a
second kept an FFN worker's serving thread from running for tens of seconds (measured: a 2 s
pause took over 20 s) and an idle attention worker on a full core. The files live in a folder
named after the server's root process; the API server's ``/health`` only reads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from afd_common.vllm_glue import server_root

logger = logging.getLogger("vllm.afd")


def status_dir() -> Path | None:
    pid = server_root.pid()
    return Path(tempfile.gettempdir()) / f"afd-status-{pid}" if pid else None


def _file(role: str, rank: int) -> Path | None:
    folder = status_dir()
    return None if folder is None else folder / f"{role}-{rank}.json"


def publish(role: str, rank: int, status: dict) -> None:
    """Best effort: a status that cannot be written (the folder removed at the server's exit, a
    full disk) is logged, never the end of the rank that serves."""
    path = _file(role, rank)
    if path is None:
        return
    # Per thread: a rank publishes from its serving thread and its refresh thread.
    tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp.write_text(json.dumps(status))
        os.replace(tmp, path)  # a reader sees the old status or the new one, never half of one
    except OSError as e:
        logger.warning("AFD: could not publish %s rank %d's status for /health: %s", role, rank, e)


def clear(role: str, rank: int) -> None:
    path = _file(role, rank)
    if path is not None:
        path.unlink(missing_ok=True)


def read(role: str) -> list[dict]:
    """The statuses ``role``'s ranks published, by rank."""
    folder = status_dir()
    if folder is None or not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob(f"{role}-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # removed or replaced while we read
            continue
    return out


def remove_all() -> None:
    """The server root's clean-up at exit."""
    folder = status_dir()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
