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


# Garbage only a collection finds (a cycle) whose finalizer says so: the interpreter's final
# collections at exit run it, unless the process froze its heap first.
CYCLE = textwrap.dedent("""
    class Cycle:
        def __del__(self):
            print("collected at exit", flush=True)
    c = Cycle()
    c.self = c
    del c
""")


def test_an_afd_server_and_the_processes_it_starts_exit_without_the_final_collections():
    """vLLM's processes each spent 2.5 s of CPU in those collections, one process after another,
    so a refused or stopped role took 8 s to go (34 s on two busy cores). The root, through the
    config hook, and a process it starts, through the plugin, skip them; a process of a server
    without afd does not."""
    root = textwrap.dedent("""
        import gc, os, subprocess, sys
        from afd_common.vllm_glue import lifecycle
        gc.disable()  # the cycle below must wait for the collections at exit
        if sys.argv[1] == "afd":
            lifecycle.exit_without_final_collection()  # the config hook
        child = ("import gc; gc.disable()\\n"
                 "from afd_common.vllm_glue import plugin\\n"
                 "plugin.register()\\n" + sys.argv[2])
        print("child:", subprocess.run([sys.executable, "-c", child], capture_output=True,
                                       text=True).stdout.strip(), flush=True)
    """) + CYCLE
    for server, collected in (("afd", False), ("plain", True)):
        r = subprocess.run([sys.executable, "-c", root, server, CYCLE], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        expected = "collected at exit" if collected else ""
        assert lines[0] == f"child: {expected}", (server, r.stdout)
        assert ("collected at exit" in lines[1:]) == collected, (server, r.stdout)
