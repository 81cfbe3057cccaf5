"""The server launcher that afd-bench, afd-demo and the e2e tier share
(afd_common.tools.launch), where its own logic can be checked without a vLLM server."""

from __future__ import annotations

import subprocess
import sys

from afd_common.tools.launch import Server, wait_gone


class ExitsJustAfterEachPoll(subprocess.Popen):
    """A process whose every ``poll`` comes just before it exits: it never reaps it."""

    def poll(self):
        return None


def test_a_server_gone_has_its_exit_code_whenever_it_exited(tmp_path):
    """The e2e tier checks a server stopped on purpose exited 0: wait_gone must not report it
    gone (a zombie is no live process) with no exit code read yet."""
    server = Server("t", "model", 0, tmp_path / "t.log")
    server.proc = ExitsJustAfterEachPoll([sys.executable, "-c", "raise SystemExit(3)"],
                                         start_new_session=True)
    assert wait_gone([server], 30)
    assert server.proc.returncode == 3
