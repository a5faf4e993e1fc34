"""The FastAPI app (`build_app`) and the blocking entry point the CLI calls (`run_server`).

Lifespan: the engine thread starts with the app; on SIGINT/SIGTERM uvicorn stops accepting,
waits up to the graceful timeout for open requests, cancels the rest (which aborts them),
then the lifespan hook stops the engine thread and the stage processes.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..config import EngineConfig
from . import routes
from .bridge import AsyncEngine
from .errors import APIError, install_error_handlers
from .metrics import CONTENT_TYPE, ServerMetrics
from .serving import Serving

log = logging.getLogger("stagewise.server")


def default_model_name(config: EngineConfig) -> str:
    return config.model or "stagewise-demo"


def build_app(engine_bridge: AsyncEngine, served_model_name: str | None = None) -> FastAPI:
    """An app around a (not yet started) bridge; the app's lifespan starts and stops it."""
    bridge = engine_bridge
    name = served_model_name or default_model_name(bridge.engine.config)
    aliases = tuple(a for a in (bridge.engine.config.model, str(bridge.engine.model_dir),
                                os.path.basename(str(bridge.engine.model_dir).rstrip("/"))) if a)
    metrics = ServerMetrics(lambda: bridge.snapshot, name)
    bridge.metrics = metrics
    serving = Serving(bridge, name, aliases)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge.start()
        log.info("serving %s (max_model_len %d)", name, serving.max_model_len)
        yield
        log.info("shutting down: stopping the engine")
        await asyncio.to_thread(bridge.stop)

    app = FastAPI(title="stagewise", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.state.bridge, app.state.metrics, app.state.serving = bridge, metrics, serving

    def counted(handler):
        async def endpoint(raw: Request):
            try:
                return await handler(serving, raw)
            except APIError as exc:
                if 400 <= exc.status < 500:
                    metrics.reject()
                raise
        return endpoint

    app.add_api_route("/v1/completions", counted(routes.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", counted(routes.chat_completions), methods=["POST"])
    app.add_api_route("/generate", counted(routes.generate), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "stagewise",
                "root": str(bridge.engine.model_dir), "max_model_len": serving.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if bridge.is_healthy:
            return {"status": "ok"}
        why = bridge.dead or "The server is shutting down."
        return JSONResponse(APIError(f"Unhealthy: {why}", 503, None, None, "service_unavailable").body(),
                            status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def run_server(config: EngineConfig, host: str, port: int, served_model_name: str | None = None, *,
               graceful_timeout_s: float = 10.0, log_level: str = "info") -> None:
    """Build the engine (blocking: loads and captures), then serve until SIGINT/SIGTERM."""
    import uvicorn
    from ..engine.engine import Engine
    from ..model.source import resolve_model
    engine = Engine(config.replace(model=resolve_model(config.model)))
    bridge = AsyncEngine(engine)
    try:
        app = build_app(bridge, served_model_name)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout_s,
                    access_log=False)
    finally:
        bridge.stop()          # a no-op after the lifespan hook; needed if uvicorn failed to start
