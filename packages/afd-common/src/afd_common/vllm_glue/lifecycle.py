"""Ending a role that cannot go on, through vLLM's own shutdown paths.

The attention role cannot serve without its FFN role; the FFN role, a service, outlives its
attention roles (afd_ffn.service) and ends only on a failure of its own. Who notices is a worker;
what must happen is server-wide:

* The worker marks the server's root process (the first vLLM process, recorded by the plugin)
  failed and ends itself. vLLM's worker monitor then fails the engine: in-flight requests get an
  error response (a SIGTERM would instead wait for them forever), ``/health`` answers 503, and
  vLLM's watchdog stops the server. A role can fail after its engine started but before its HTTP
  server did, where neither the watchdog nor every SIGTERM takes effect, so the root also stops
  itself when vLLM has not within a few seconds, repeating SIGTERM until it goes. (An attention
  role whose connection fails while vLLM is still starting fails the start-up itself.)
  ``vllm serve`` then exits with ``FAILED_EXIT_CODE``. An attention worker in the middle
  of a step is not ended from outside: the step's own receive raises, with the same outcome.

The reason is logged first, so it is what an operator reads last.

Every AFD process also ends without the interpreter's last garbage collections
(``exit_without_final_collection``, ``inherit_quick_exit``). A role's processes stop one after
another (worker, engine core, API server), and each spent 2.5-2.8 s of CPU there, for memory the
operating system frees anyway: a refused attention role took 8 s to go on an idle machine and
34 s with six other busy sessions on two cores; now 2 s and 6 s.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time

from afd_common.vllm_glue import role_status, server_root

logger = logging.getLogger("vllm.afd")

#: Sent by a worker to its server root: "this server failed; exit non-zero when you stop".
FAILED_SIGNAL = signal.SIGUSR1
#: Exit status of a ``vllm serve`` role whose AFD peer was lost.
FAILED_EXIT_CODE = 3
STOP_RETRY_S = 5.0
#: Set by an AFD server's root: its processes end without the final garbage collections.
QUICK_EXIT_ENV = "AFD_QUICK_EXIT"

_lock = threading.Lock()
_failed = False
_root_failed = False
_root_installed = False
_exit_hook_installed = False


def _root_pid() -> int:
    pid = server_root.pid()
    return 0 if pid == os.getpid() else pid


def _signal_root(sig: int) -> bool:
    pid = _root_pid()
    if pid <= 0:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def mark_failed(reason: str) -> None:
    """Log why this role cannot go on (once) and tell the server root to exit non-zero."""
    global _failed
    with _lock:
        first, _failed = not _failed, True
    if first:
        logger.error("AFD: %s -- ending this role", reason)
        _signal_root(FAILED_SIGNAL)


def exit_worker() -> None:
    """End this worker process now; vLLM's worker monitor then fails the engine, which fails
    every in-flight request with an error response."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(FAILED_EXIT_CODE)


def exit_without_final_collection() -> None:
    """In an AFD server's root (the config hook): this process and every vLLM process it starts
    (they inherit the environment) end without the final collections -- unless the user set
    ``AFD_QUICK_EXIT=0``: finalizers of objects in reference cycles (their own code's, say)
    then still run at exit."""
    if os.environ.get(QUICK_EXIT_ENV) == "0":
        return
    os.environ[QUICK_EXIT_ENV] = "1"
    _freeze_at_exit()


def inherit_quick_exit() -> None:
    """In every vLLM process (the plugin's ``register``): a process an AFD server started ends
    without the final collections too."""
    if os.environ.get(QUICK_EXIT_ENV) == "1":
        _freeze_at_exit()


def _freeze_at_exit() -> None:
    # After the atexit handlers registered from now on (vLLM's shutdown among them), freeze the
    # heap: the interpreter's final collections skip frozen objects. Nothing afd or vLLM holds is
    # released by a collection at exit alone: sockets and memory go with the process, shared
    # memory with vLLM's own handlers and the resource tracker.
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        atexit.register(gc.freeze)


def install_root_failure_handler() -> None:
    """In the server root's main thread: on a worker's failure report, exit with
    ``FAILED_EXIT_CODE`` once vLLM's own shutdown has run (it would otherwise exit 0) and, if
    vLLM does not stop by itself within ``STOP_RETRY_S`` (a failure between the engine's start
    and the HTTP server's, where vLLM's watchdog does not run yet), stop the server."""
    if os.getpid() != server_root.pid():
        return
    if threading.current_thread() is not threading.main_thread():
        return
    global _root_installed
    if _root_installed:
        return
    _root_installed = True
    role_status.remove_all()  # a reused process id's, if any
    atexit.register(role_status.remove_all)
    signal.signal(FAILED_SIGNAL, lambda signum, frame: _on_failed())


def _on_failed() -> None:
    global _root_failed
    if _root_failed:
        return
    _root_failed = True
    atexit.register(_exit_failed)
    threading.Thread(target=_keep_stopping, daemon=True, name="afd-stop").start()


def _keep_stopping() -> None:
    # First give vLLM's own dead-engine watchdog its chance (it stops a serving server within
    # seconds); vLLM swallows a SIGTERM that lands at some points of its start-up, so repeat.
    while True:
        time.sleep(STOP_RETRY_S)
        os.kill(os.getpid(), signal.SIGTERM)


def _exit_failed() -> None:
    # Registered last, so it runs first among atexit handlers, after vLLM stopped its engine.
    role_status.remove_all()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(FAILED_EXIT_CODE)
