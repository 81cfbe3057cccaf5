"""A worker that cannot go on ends the server non-zero, through vLLM's own shutdown.

Real processes, no vLLM: a "root" that installs the failure handler and a "worker" child that
calls the lifecycle functions the role workers call.
"""

from __future__ import annotations

import os
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


def _start(args: list[str], quick_exit: str | None) -> subprocess.Popen:
    """A Python process with ``AFD_QUICK_EXIT`` as given (None: unset, whatever ours holds)."""
    env = {k: v for k, v in os.environ.items() if k != lifecycle.QUICK_EXIT_ENV}
    if quick_exit is not None:
        env[lifecycle.QUICK_EXIT_ENV] = quick_exit
    return subprocess.Popen([sys.executable, "-c", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_an_afd_server_and_the_processes_it_starts_exit_without_the_final_collections():
    """vLLM's processes each spent 2.5 s of CPU in those collections, one process after another,
    so a refused or stopped role took 8 s to go (34 s on two busy cores). The root, through the
    config hook, and a process it starts, through the plugin, skip them; a process of a server
    without afd does not, nor one whose user set ``AFD_QUICK_EXIT=0``."""
    root = textwrap.dedent("""
        import gc, os, subprocess, sys
        from afd_common.vllm_glue import lifecycle
        gc.disable()  # the cycle below must wait for the collections at exit
        if sys.argv[1] != "plain":
            lifecycle.exit_without_final_collection()  # the config hook
        child = ("import gc; gc.disable()\\n"
                 "from afd_common.vllm_glue import plugin\\n"
                 "plugin.register()\\n"
                 "print('child ran', flush=True)\\n" + sys.argv[2])
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
        print("child:", r.returncode, r.stdout.splitlines(), flush=True)
    """) + CYCLE
    runs = {server: _start([root, server, CYCLE], "0" if server == "opted out" else None)
            for server in ("afd", "plain", "opted out")}
    for server, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        lines = out.splitlines()
        collected = server != "afd"
        child = ["child ran"] + (["collected at exit"] if collected else [])
        assert lines[0] == f"child: 0 {child}", (server, out, err)
        assert ("collected at exit" in lines[1:]) == collected, (server, out)


def test_vllms_config_hook_is_what_makes_a_server_exit_without_the_final_collections(tmp_path):
    """The same through vLLM's own path (EngineArgs -> VllmConfig, where the hook runs in the
    API server), with ``AFD_QUICK_EXIT=0`` as the control: the cycle is left alone because of
    the hook, not because of something vLLM does."""
    from afd_common.tools.tiny_model import write_tiny_model

    model = write_tiny_model("mixtral", tmp_path / "mixtral", num_layers=2)
    script = textwrap.dedent("""
        import gc, sys
        from vllm.engine.arg_utils import EngineArgs
        from afd_common.vllm_glue.patches import vllm_config
        vllm_config.build().install()
        gc.disable()
        EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True,
                   additional_config={"afd": {"role": "ffn", "compute_gate_on_attention": True}}
                   ).create_engine_config()
        print("configured", flush=True)
    """) + CYCLE
    runs = {value: _start([script, str(model)], value) for value in (None, "0")}
    for value, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0 and "configured" in out.splitlines(), err[-3000:]
        assert ("collected at exit" in out.splitlines()) == (value == "0"), (value, out)
