"""The roles' HTTP front ends: the AFD series on ``/metrics``, an honest ``/health``, and for
the FFN role a clear refusal of generation requests.

vLLM's own ``/health`` asks only whether the engine process is alive. The FFN role is healthy
when that and its ranks' serving loops are; the attention role is not while a rank waits for an
FFN role to come back (503 with the reason). Both read what the workers published
(afd_common.vllm_glue.role_status), so a probe never wakes a worker.
Installed by wrapping ``init_entrypoints_middleware``, which ``build_app`` looks up at call time.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from afd_common.config import parse_afd_config
from afd_common.vllm_glue.patching import PatchSet

logger = logging.getLogger("vllm.afd")

FFN_REFUSAL = ("this server is an AFD FFN role: it runs the experts for its attention role and "
               "serves no generation requests; send requests to the attention role's server")
ALLOWED_PATHS = ("/health", "/metrics", "/ping", "/version", "/v1/models", "/load")


def _afd_section(args) -> dict | None:
    extra = getattr(args, "additional_config", None)
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return None
    return extra.get("afd") if isinstance(extra, dict) else None


def add_ffn_guard(app) -> None:
    from fastapi.responses import JSONResponse

    from afd_common.vllm_glue import role_status

    async def afd_ffn_guard(request, call_next):
        path = request.url.path
        if path == "/health":
            engine = await call_next(request)  # vLLM's: the engine is alive
            states = role_status.read("ffn")
            now = time.time()
            for s in states:
                last = s.pop("last_step_at", None)
                s["seconds_since_last_step"] = None if last is None else round(now - last, 3)
            healthy = engine.status_code == 200 and bool(states) and all(
                s.get("healthy") for s in states)
            body = {"afd_role": "ffn", "healthy": healthy, "ranks": states}
            if engine.status_code != 200:
                body["error"] = f"vLLM's engine is not healthy ({engine.status_code})"
            return JSONResponse(body, status_code=200 if healthy else 503)
        if path.startswith(ALLOWED_PATHS) or not path.startswith("/v"):
            return await call_next(request)
        return JSONResponse({"error": {"message": FFN_REFUSAL, "type": "BadRequestError",
                                       "code": 400}}, status_code=400)

    app.middleware("http")(afd_ffn_guard)


def add_attention_health(app) -> None:
    from fastapi.responses import JSONResponse

    from afd_common.vllm_glue import role_status

    async def afd_attention_health(request, call_next):
        if request.url.path != "/health":
            return await call_next(request)
        waiting = role_status.read("attention")
        if not waiting:
            return await call_next(request)
        return JSONResponse({"afd_role": "attention", "healthy": False,
                             "reason": "waiting for an FFN role to come back; requests in "
                                       "flight resume when it does", "ranks": waiting},
                            status_code=503)

    app.middleware("http")(afd_attention_health)


async def ask_workers(engine_client, method: str) -> list:
    """``method`` on every worker of every engine: with DP each engine core has its own
    workers, and vLLM's ``collective_rpc`` asks only the first engine."""
    core = getattr(engine_client, "engine_core", None)
    if hasattr(core, "call_utility_all_async"):
        per_engine = await core.call_utility_all_async("collective_rpc", method, 10, (), None)
        return [r for results in per_engine for r in results]
    return await engine_client.collective_rpc(method, timeout=10)


def add_metrics(app) -> None:
    """The AFD series join vLLM's ``/metrics`` response.

    They are recorded in the workers (afd_common.metrics), so each scrape first asks them for a
    snapshot. They are appended to the response rather than registered with a registry: with
    several API servers vLLM renders a fresh multi-process registry per scrape, which no
    collector of ours can join.
    """
    from starlette.responses import Response

    from afd_common.metrics import render

    async def afd_metrics(request, call_next):
        if not request.url.path.startswith("/metrics"):
            return await call_next(request)
        try:
            snaps = await ask_workers(request.app.state.engine_client, "afd_metrics")
            snaps = [s for s in snaps if s]
        except Exception as e:  # noqa: BLE001 - serve vLLM's metrics anyway, say why ours lag
            logger.warning("AFD metrics: could not fetch the workers' series: %r", e)
            snaps = []
        # An uncompressed body, so the series can be appended to it.
        request.scope["headers"] = [(k, v) for k, v in request.scope["headers"]
                                    if k != b"accept-encoding"]
        response = await call_next(request)
        if not snaps or response.status_code != 200:
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        content_type = response.headers.get("content-type", "")
        openmetrics = content_type.startswith("application/openmetrics-text")
        ours = render(snaps, openmetrics)
        if openmetrics and body.endswith(b"# EOF\n"):
            body = body[:-len(b"# EOF\n")] + ours + b"# EOF\n"
        else:
            body += ours
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(body, status_code=200, headers=headers)

    app.middleware("http")(afd_metrics)


def build() -> PatchSet | None:
    # Only the API server process has imported the app module by the time plugins load.
    app_module = sys.modules.get("vllm.entrypoints.launchers.app")
    if app_module is None:
        return None
    original = app_module.init_entrypoints_middleware

    def init_entrypoints_middleware(args, app, *rest, **kwargs):
        original(args, app, *rest, **kwargs)
        section = _afd_section(args)
        if section is None:
            return
        if parse_afd_config(section).is_ffn:
            add_ffn_guard(app)
        else:
            add_attention_health(app)
        add_metrics(app)

    return PatchSet("api_server").setattr(app_module, "init_entrypoints_middleware",
                                          init_entrypoints_middleware)
