"""A worker that cannot go on ends the server non-zero, through vLLM's own shutdown.

Real processes, no vLLM: a "root" that installs the failure handler and a "worker" child that
calls the lifecycle functions the role workers call.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from afd_common import lifecycle

ROOT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    os.environ["AFD_SERVER_PID"] = str(os.getpid())
    from afd_common import lifecycle
    lifecycle.install_root_failure_handler(stop=sys.argv[2] == "stop")
    stopped = []
    signal.signal(signal.SIGTERM, lambda *a: stopped.append(True))  # vLLM's graceful stop
    worker = subprocess.run([sys.executable, "-c", sys.argv[1]])
    time.sleep(0.2)  # let the signals land
    print(f"worker exit {worker.returncode}, stopped {bool(stopped)}", flush=True)
""")


def run_root(worker_code: str, stop: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ROOT, textwrap.dedent(worker_code),
                           "stop" if stop else "wait"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("stop", [False, True], ids=["attention-root", "ffn-root"])
def test_failed_worker_ends_itself_and_the_root_exits_non_zero(stop):
    r = run_root(stop=stop, worker_code="""
        from afd_common import lifecycle
        lifecycle.mark_failed("FFN rank 0 failed: lost attention rank 0")
        lifecycle.mark_failed("a second report is not logged again")
        lifecycle.exit_worker()
        print("not reached")
    """)
    assert r.returncode == lifecycle.FAILED_EXIT_CODE, r.stderr
    # The FFN root stops itself; the attention root leaves that to vLLM's dead-engine watchdog.
    assert f"worker exit {lifecycle.FAILED_EXIT_CODE}, stopped {stop}" in r.stdout
    assert "not reached" not in r.stdout
    assert r.stderr.count("AFD: ") == 1 and "lost attention rank 0" in r.stderr
