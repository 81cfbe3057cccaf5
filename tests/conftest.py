"""How ``scripts/test.sh`` shares the tests between its two pytest-xdist workers.

The end-to-end tests start vLLM servers that need both cores while they load and leave one idle
for minutes while they wait (for the other role, a reconnect timeout, a restarted FFN role). So
one worker runs the end-to-end tests, in order (the big pairs, the ride-through and the hosts
cases never overlap each other), while the other runs the unit and multi-process tests beside
them, a file at a time; then the small end-to-end pairs (``any_worker``: 1A1F and the like) go
one at a time to whichever worker is free. Both share one set of checkpoints and one colocated
reference (tests/e2e/conftest.py). xdist's own ``--dist loadgroup`` cannot say this: it renames
node ids, which pytest 9 no longer allows, and its groups are silently ignored.
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
        # A worker would outlive a killed run (CI's timeout) and go on starting servers: it gets
        # the SIGTERM too, which the hosts fixture turns into a teardown that removes its
        # network namespaces (tests/e2e/conftest.py), as in a run without workers.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def pytest_collection_modifyitems(items):
    # The end-to-end tests that share a worker first, whatever paths were given; the ones the
    # scheduler below hands out one at a time last.
    def rank(item) -> int:
        if item.get_closest_marker("any_worker") is not None:
            return 2
        return 0 if item.nodeid.startswith(E2E) else 1
    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndBesideTheRest(LoadScopeScheduling):
        leading: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if not nodeid.startswith(E2E):
                return nodeid.split("::", 1)[0]
            if self.leading is None:  # the e2e tests before the first other one: one unit
                self.leading = set()
                for n in self.collection:
                    if not n.startswith(E2E):
                        break
                    self.leading.add(n)
            return E2E if nodeid in self.leading else nodeid

        def _reschedule(self, node) -> None:
            # One test queued behind the running one (a worker must know its next test to run
            # one), not xdist's up to three: no worker holds back small pairs the other could run.
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 1:
                scope, unit = next(iter(self.workqueue.items()))
                if all(unit.values()):  # a crashed worker's finished tests, put back by xdist:
                    del self.workqueue[scope]  # sent, they would leave this worker waiting
                    continue
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

    # Collection order, which puts tests/e2e first: the longest worker's share starts at once
    # (xdist would otherwise queue first the files with the most tests).
    config.option.loadscopereorder = False
    return EndToEndBesideTheRest(config, log)
