"""A worker that cannot go on ends the server non-zero, through vLLM's own shutdown.

Real processes, no vLLM: a "root" that installs the failure handler and a "worker" child that
calls the lifecycle functions the role workers call.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


from afd_common.vllm_glue import lifecycle

ROOT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    os.environ["AFD_SERVER_PID"] = str(os.getpid())
    from afd_common.vllm_glue import lifecycle
    lifecycle.install_root_failure_handler()
    stopped = []
    signal.signal(signal.SIGTERM, lambda *a: stopped.append(True))  # vLLM's graceful stop
    worker = subprocess.run([sys.executable, "-c", sys.argv[1]])
    time.sleep(lifecycle.STOP_RETRY_S + 0.5)  # let the signals land
    print(f"worker exit {worker.returncode}, stopped {bool(stopped)}", flush=True)
""")


def run_root(worker_code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ROOT, textwrap.dedent(worker_code)],
                          capture_output=True, text=True, timeout=120)


def test_failed_worker_ends_itself_and_the_root_stops_and_exits_non_zero():
    """A server vLLM did not stop by itself within STOP_RETRY_S (a role failing between its
    engine's start and its HTTP server's) is stopped by its root."""
    r = run_root(worker_code="""
        from afd_common.vllm_glue import lifecycle
        lifecycle.mark_failed("FFN rank 0 failed: lost attention rank 0")
        lifecycle.mark_failed("a second report is not logged again")
        lifecycle.exit_worker()
        print("not reached")
    """)
    assert r.returncode == lifecycle.FAILED_EXIT_CODE, r.stderr
    assert f"worker exit {lifecycle.FAILED_EXIT_CODE}, stopped True" in r.stdout
    assert "not reached" not in r.stdout
    assert r.stderr.count("AFD: ") == 1 and "lost attention rank 0" in r.stderr
