"""The attention role's ``/health``: 200 only while every worker is connected to its FFN role,
else 503 with the reason (an attention role starts, and stays up, without its FFN role)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Response
from fastapi.testclient import TestClient

from afd_common.patches.api_server import add_attention_health


class Engine:
    """vLLM's engine client, as the middleware asks it (one engine, its workers' answers)."""

    def __init__(self, states=None, error: Exception | None = None):
        self.states, self.error = states, error

    async def collective_rpc(self, method, timeout=None):
        assert method == "afd_attention_status"
        if self.error:
            raise self.error
        return self.states


def client(engine: Engine, vllm_status: int = 200) -> TestClient:
    app = FastAPI()

    @app.get("/health")
    def health():  # vLLM's own: the engine is alive
        return Response(status_code=vllm_status)

    @app.get("/v1/models")
    def models():
        return {"data": []}

    app.state.engine_client = engine
    add_attention_health(app)
    return TestClient(app)


WAITING = {"rank": 0, "state": "waiting", "connected": False, "waiting_s": 61.0,
           "reason": "waiting for the FFN role at 10.0.0.2:29600"}
SERVING = {"rank": 1, "state": "serving", "connected": True, "steps": 9}


@pytest.mark.parametrize("states,status,reason", [
    ([SERVING], 200, None),
    ([WAITING, SERVING], 503, "waiting for the FFN role at 10.0.0.2:29600"),
    ([{"rank": 0, "state": "failed", "connected": False, "error": "the FFN role is gone"}], 503,
     "the FFN role is gone"),
    ([{"rank": 0, "state": "loading", "connected": False}], 503, "loading"),
])
def test_healthy_only_when_every_worker_is_connected(states, status, reason):
    r = client(Engine(states)).get("/health")
    assert r.status_code == status
    if reason:
        assert r.json()["reason"] == reason and r.json()["ranks"] == states


def test_workers_that_do_not_answer_are_not_healthy_and_other_paths_untouched():
    c = client(Engine(error=TimeoutError("no answer in 10 s")))
    r = c.get("/health")
    assert r.status_code == 503 and "did not answer" in r.json()["reason"]
    assert c.get("/v1/models").status_code == 200
    # A dead engine is vLLM's 503, passed on without asking the workers.
    assert client(Engine(error=AssertionError("asked")), vllm_status=503).get(
        "/health").status_code == 503
