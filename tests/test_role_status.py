"""The attention role's ``/health`` says 503, and why, while a rank waits for an FFN role: read
from the files the waiting workers leave, so probing never wakes a worker."""

from __future__ import annotations

import tempfile

from fastapi import FastAPI
from fastapi.testclient import TestClient

from afd_common.vllm_glue import role_status
from afd_common.vllm_glue.patches.api_server import add_attention_health
from afd_common.vllm_glue.server_root import SERVER_PID_ENV


def test_health_is_503_with_the_reason_while_a_rank_waits_and_vllms_own_otherwise(
        monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(SERVER_PID_ENV, "31337")
    app = FastAPI()
    app.get("/health")(lambda: {"vllm": "ok"})
    app.get("/v1/models")(lambda: {"data": []})
    add_attention_health(app)
    client = TestClient(app)
    assert client.get("/health").json() == {"vllm": "ok"}

    role_status.publish("attention", 1, {"rank": 1, "reason": "attention rank 1: the FFN role is gone",
                                "lost_at": 0.0, "reconnect_timeout_s": 120.0})
    r = client.get("/health")
    assert r.status_code == 503
    body = r.json()
    assert body["afd_role"] == "attention" and body["healthy"] is False
    assert "waiting for an FFN role" in body["reason"]
    assert body["ranks"][0]["reason"] == "attention rank 1: the FFN role is gone"
    assert client.get("/v1/models").status_code == 200  # other paths are vLLM's

    role_status.clear("attention", 1)
    assert client.get("/health").status_code == 200
    role_status.publish("attention", 0, {"rank": 0})
    role_status.remove_all()  # the server root at exit
    assert not (tmp_path / "afd-status-31337").exists()
    assert client.get("/health").status_code == 200


def test_no_server_root_means_no_status_files(monkeypatch):
    monkeypatch.delenv(SERVER_PID_ENV, raising=False)
    role_status.publish("attention", 0, {"rank": 0})  # outside a vLLM server: nothing to tell
    assert role_status.read("attention") == []


def test_ffn_health_is_what_the_ranks_published_and_vllms_engine_check(monkeypatch, tmp_path):
    import time

    from fastapi.responses import JSONResponse

    from afd_common.vllm_glue.patches.api_server import add_ffn_guard

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(SERVER_PID_ENV, "31338")
    engine = {"ok": True}
    app = FastAPI()
    app.get("/health")(lambda: JSONResponse({}, status_code=200 if engine["ok"] else 503))
    add_ffn_guard(app)
    client = TestClient(app)
    assert client.get("/health").status_code == 503  # no rank published yet

    for rank in (0, 1):
        role_status.publish("ffn", rank, {"rank": rank, "state": "serving", "healthy": True,
                                         "steps": 7, "last_step_at": time.time() - 2.0})
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["healthy"]
    ranks = r.json()["ranks"]
    assert [s["rank"] for s in ranks] == [0, 1]
    assert 1.9 < ranks[0]["seconds_since_last_step"] < 10 and "last_step_at" not in ranks[0]

    role_status.publish("ffn", 1, {"rank": 1, "state": "failed", "healthy": False,
                                   "error": "AFDPeerError: boom", "last_step_at": None})
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["ranks"][1]["error"] == "AFDPeerError: boom"
    role_status.clear("ffn", 1)
    engine["ok"] = False  # the engine died: vLLM's check decides
    r = client.get("/health")
    assert r.status_code == 503 and "engine" in r.json()["error"]
    assert client.post("/v1/completions").status_code == 400  # still no generation here


def test_two_threads_of_a_rank_publish_at_once_and_a_removed_folder_is_no_failure(
        monkeypatch, tmp_path, caplog):
    """An FFN rank publishes from its serving thread (state changes) and its refresh thread; in
    the fresh-clone run both once wrote the same temporary file, and the loser's rename failed
    the rank. A status that cannot be written is logged, never the end of the rank."""
    import threading

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(SERVER_PID_ENV, "31338")
    errors: list = []

    def publish_many(state):
        try:
            for i in range(300):
                role_status.publish("ffn", 0, {"rank": 0, "state": state, "i": i})
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)
    threads = [threading.Thread(target=publish_many, args=(s,)) for s in ("serving", "waiting")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(role_status.read("ffn")) == 1
    assert not list(role_status.status_dir().glob("*.tmp"))

    role_status.remove_all()
    role_status.status_dir().write_text("not a folder")  # what a publish cannot write into
    role_status.publish("ffn", 0, {"rank": 0})
    assert "could not publish ffn rank 0's status" in caplog.text
