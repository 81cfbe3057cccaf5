"""How ``scripts/test.sh`` shares the tests between its two pytest-xdist workers.

The end-to-end tests share servers, hosts and the colocated reference, and each starts vLLM
servers that need both cores while they load but leave one idle for minutes while they wait (for
the other role, a reconnect timeout, a restarted FFN role). So one worker runs all of them, in
order, and the other runs the unit and multi-process tests beside them, a file at a time; once it
has none left it stops, and the end-to-end worker takes any file still queued when it is done.
(xdist's own ``--dist loadgroup`` would say the same with a marker, but it renames node ids, which
pytest 9 no longer allows: the groups are silently ignored.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import pytest

E2E = "tests/e2e/"
PR_SET_PDEATHSIG = 1


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") and sys.platform == "linux":
        # A worker would outlive a killed run (CI's timeout) and keep its servers and network
        # namespaces: it gets the SIGTERM too, which the fixtures that own those turn into a
        # teardown (tests/e2e/conftest.py).
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return E2E if nodeid.startswith(E2E) else nodeid.split("::", 1)[0]

    # Collection order, which puts tests/e2e first: the longest worker's share starts at once
    # (xdist would otherwise queue first the files with the most tests).
    config.option.loadscopereorder = False
    return EndToEndOnOneWorker(config, log)
