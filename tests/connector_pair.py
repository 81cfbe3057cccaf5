"""Both halves of a connector in this process, 1:1, each ``init`` in its own thread as two
roles would run it: for tests that drive both sides step by step."""

from __future__ import annotations

import threading

from afd_common.config import parse_afd_config
from afd_common.registry import resolve_connector
from afd_common.tools.launch import free_port


def open_pair(connector: str, shape, extra: dict):
    """(attention half, FFN half), initialised; ``extra`` is the connector_extra_config."""
    port = free_port()
    a, f = (resolve_connector(connector, role)(parse_afd_config(
        {"role": role, "port": port, "connector": connector, "connector_extra_config": extra}),
        0, shape) for role in ("attention", "ffn"))
    t = threading.Thread(target=f.init)
    t.start()
    a.init()
    t.join(30)
    return a, f
