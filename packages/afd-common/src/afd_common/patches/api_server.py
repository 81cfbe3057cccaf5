"""The FFN role's HTTP front end: a clear refusal for generation requests, an honest /health.

vLLM's own ``/health`` asks only whether the engine process is alive; the FFN role is healthy
when its FFN loop is, so ``/health`` asks every worker (``afd_ffn_status``). Installed by wrapping
``init_entrypoints_middleware``, which ``build_app`` looks up at call time.
"""

from __future__ import annotations

import json
import logging
import sys

from afd_common.config import parse_afd_config
from afd_common.patching import PatchSet

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

    async def afd_ffn_guard(request, call_next):
        path = request.url.path
        if path == "/health":
            try:
                states = await request.app.state.engine_client.collective_rpc(
                    "afd_ffn_status", timeout=10)
            except Exception as e:  # noqa: BLE001 - any failure means not healthy
                return JSONResponse({"afd_role": "ffn", "healthy": False, "error": repr(e)},
                                    status_code=503)
            healthy = bool(states) and all(s.get("healthy") for s in states)
            return JSONResponse({"afd_role": "ffn", "healthy": healthy, "ranks": states},
                                status_code=200 if healthy else 503)
        if path.startswith(ALLOWED_PATHS) or not path.startswith("/v"):
            return await call_next(request)
        return JSONResponse({"error": {"message": FFN_REFUSAL, "type": "BadRequestError",
                                       "code": 400}}, status_code=400)

    app.middleware("http")(afd_ffn_guard)


def build() -> PatchSet | None:
    # Only the API server process has imported the app module by the time plugins load.
    app_module = sys.modules.get("vllm.entrypoints.launchers.app")
    if app_module is None:
        return None
    original = app_module.init_entrypoints_middleware

    def init_entrypoints_middleware(args, app, *rest, **kwargs):
        original(args, app, *rest, **kwargs)
        section = _afd_section(args)
        if section is not None and parse_afd_config(section).is_ffn:
            add_ffn_guard(app)

    return PatchSet("api_server").setattr(app_module, "init_entrypoints_middleware",
                                          init_entrypoints_middleware)
