"""The roles on different hosts: network namespaces joined by a bridge, each with its own address
and loopback (tests/e2e/hosts.py). Root only; without namespaces the test fails, it never skips."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from afd_common.launch import PROMPTS, compare, complete, wait_gone
from afd_common.lifecycle import FAILED_EXIT_CODE

from .conftest import NUM_PROMPTS, afd_pair, long_request, say
from afd_common.bench.hosts import Hosts

pytestmark = pytest.mark.e2e
ATTENTION, FFN = 0, 1  # host indices
STEP_TIMEOUT_S = 10


def _connects(hosts: Hosts | None, i: int, address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` from host ``i`` (None: this process's
    namespace) is accepted."""
    probe = ("import socket,sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])),"
             " timeout=5).close()\nexcept OSError:\n    sys.exit(1)")
    wrap = [] if hosts is None else hosts.wrap(i)
    return subprocess.run([*wrap, sys.executable, "-c", probe, address, str(port)],
                          timeout=30).returncode == 0


def test_roles_on_two_hosts_give_the_colocated_answer_and_a_cut_link_fails_fast(
        hosts, models, colocated, logs):
    with afd_pair("hosts", logs, models["qwen3_moe"], hosts=hosts,
                  connector_extra_config={"step_timeout_s": STEP_TIMEOUT_S,
                                          "reconnect_timeout_s": 0}) as pair:
        attention, ffn, port = pair.attention, pair.ffn, pair.port
        problems = compare(complete(attention, PROMPTS[:NUM_PROMPTS]), colocated["qwen3_moe"])
        assert not problems, "\n".join(problems)

        # The rendezvous listens on the configured address only: reachable there from the other
        # host, refused on the FFN host's loopback.
        assert _connects(hosts, ATTENTION, hosts.address(FFN), port)
        assert not _connects(hosts, FFN, "127.0.0.1", port)

        # Unplug the FFN host mid-decode: no connection closes, so only the step timeout can end
        # the wait. The request fails within it and the attention role stops (status 3).
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(long_request, attention)
            time.sleep(1.5)
            assert not fut.done(), "generation finished before the cut; make it longer"
            cut = time.monotonic()
            hosts.cut(FFN)
            status, detail = fut.result(timeout=STEP_TIMEOUT_S + 30)
            took = time.monotonic() - cut
        say(f"link to the FFN host cut: in-flight request ended with {status} after {took:.1f} s")
        assert status != 200 and took <= STEP_TIMEOUT_S + 10, (status, detail)
        assert wait_gone([attention], 30), attention.log_tail()
        assert attention.proc.returncode == FAILED_EXIT_CODE
        log = attention.log_path.read_text(errors="replace")
        assert f"within {float(STEP_TIMEOUT_S)} s" in log, attention.log_tail()
        # Plugged back in, the FFN host learns its peer is gone and waits for the next one.
        hosts.restore(FFN)
        end = time.monotonic() + 120
        while True:
            ranks = json.loads(urllib.request.urlopen(ffn.url + "/health", timeout=10).read())
            if ranks["ranks"][0]["state"] == "waiting" or time.monotonic() > end:
                break
            time.sleep(1)
        say(f"FFN role waiting for the next attention role {time.monotonic() - cut:.1f} s "
            f"after the cut: {ranks}")
        assert ranks["ranks"][0]["state"] == "waiting" and not ffn.exited(), ffn.log_tail()
