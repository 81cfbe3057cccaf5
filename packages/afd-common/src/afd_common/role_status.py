"""What an attention worker waiting for its FFN role tells its server's ``/health``: a file.

While an attention rank waits for an FFN role to come back it serves nothing, and a load
balancer must hear so (503). Asking the workers on every probe (vLLM's ``collective_rpc``) would
wake them: vLLM's shared-memory queue reader spins for a second after each message, so a prober
keeps an idle worker on a full core and starves the very role it waits for on a small machine.
So the worker writes one small JSON file while it waits, in a folder named after its server's
root process, and the API server's ``/health`` only reads that folder (no file: vLLM's own
answer).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from afd_common.plugin import SERVER_PID_ENV


def status_dir() -> Path | None:
    pid = os.environ.get(SERVER_PID_ENV)
    return Path(tempfile.gettempdir()) / f"afd-status-{pid}" if pid else None


def _file(rank: int) -> Path | None:
    folder = status_dir()
    return None if folder is None else folder / f"attention-{rank}.json"


def set_waiting(rank: int, status: dict) -> None:
    path = _file(rank)
    if path is None:
        return
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)  # a reader sees the old status or the new one, never half of one


def clear(rank: int) -> None:
    path = _file(rank)
    if path is not None:
        path.unlink(missing_ok=True)


def waiting() -> list[dict]:
    """The statuses of the ranks that wait now, by rank."""
    folder = status_dir()
    if folder is None or not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("attention-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # removed or replaced while we read: not waiting then
            continue
    return out


def remove_all() -> None:
    """The server root's clean-up at exit."""
    folder = status_dir()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
