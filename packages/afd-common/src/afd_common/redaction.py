"""Keeping the AFD auth token out of every log line.

vLLM logs its non-default CLI arguments at start-up, ``--additional-config`` verbatim, so a token
given as ``connector_extra_config.auth_token`` would be printed by vLLM itself. Every log record is
rewritten as it is made: any ``auth_token`` value (quoted, as Python and JSON write it) and the
value of ``AFD_AUTH_TOKEN`` become ``***``.
"""

from __future__ import annotations

import logging
import os
import re

from afd_common.config import AUTH_TOKEN_ENV

MASK = "***"
_FIELD = re.compile(r"""(["']?auth_token["']?\s*[:=]\s*)(["'])((?:\\.|(?!\2).)*)\2""")


def redact(text: str) -> str:
    text = _FIELD.sub(lambda m: f"{m[1]}{m[2]}{MASK}{m[2]}", text)
    token = os.environ.get(AUTH_TOKEN_ENV)
    return text.replace(token, MASK) if token else text


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a broken record is the handler's to report
        return
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None


def install() -> None:
    """Redact in the log-record factory: it sees every record of every logger, and survives vLLM
    reconfiguring its handlers later (it wraps, never replaces, the factory). Idempotent."""
    inner = logging.getLogRecordFactory()
    if getattr(inner, "afd_redacting", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = inner(*args, **kwargs)
        _redact_record(record)
        return record

    factory.afd_redacting = True
    factory.afd_inner = inner
    logging.setLogRecordFactory(factory)


def uninstall() -> None:
    """Undo ``install`` when nothing wrapped the factory since (otherwise leave the chain be)."""
    current = logging.getLogRecordFactory()
    if getattr(current, "afd_redacting", False):
        logging.setLogRecordFactory(current.afd_inner)
