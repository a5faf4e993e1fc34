"""The FastAPI app (`build_app`) and the blocking entry point `stagewise serve` calls (`run_server`).

Lifespan: the engine client (the engine core runs in its own process) starts with the app and
stops after it. In front of the routes, `RequestGuard` checks the API key, content type and body size.
On SIGINT/SIGTERM the server drains (see `shutdown.py`), then the lifespan hook stops the engine
and the stage processes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..config import EngineConfig
from ..core.client import EngineClient
from ..executor.hygiene import freeze_heap
from ..multimodal.images import limits_of
from ..multimodal.intake import image_intake
from . import embeddings, lora_updates, routes, utility
from .errors import APIError, install_error_handlers
from .guard import RequestGuard, host_allowed, host_check_for
from .metrics import CONTENT_TYPE, ServerMetrics
from .options import ServerOptions, served_name_for
from .serving import Serving

log = logging.getLogger("stagewise.server")
BACKSTOP_SHUTDOWN_S = 5       # uvicorn's own wait after the drain (which already ended every request)


def build_app(engine: EngineClient, options: ServerOptions | None = None, image_limits=None) -> FastAPI:
    """An app around a (not yet started) engine client; the app's lifespan starts and stops it.
    `image_limits` (multimodal.images.ImageLimits) bound the images of a vision-language model."""
    options = options or ServerOptions()
    model_path = engine.info.model_dir
    name = options.served_model_name or served_name_for(model_path)
    # requests may still name the model by its path (the old default name); responses never show it
    aliases = tuple(a for a in (engine.info.config_model, model_path, served_name_for(model_path)) if a)
    metrics = ServerMetrics(lambda: engine.snapshot, name, engine.info.max_model_len, lambda: engine.dead is None)
    engine.metrics = metrics
    serving = Serving(engine, name, options, aliases=aliases,
                      images=image_intake(model_path, engine.info.tok, image_limits))
    if serving.max_waiting_per_key is not None:
        metrics.key_waiting = lambda: serving.waiting_by_key
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s as %r (max_model_len %d)", model_path, name, serving.max_model_len)
        yield
        log.info("shutting down: stopping the engine")
        serving.close()
        await asyncio.to_thread(engine.stop)

    # NOTE: no slash redirects: a 307 to a Location built from the client's Host header, before the
    # API-key check, for a route that does not exist as written; a wrong path is a 404
    app = FastAPI(title="stagewise", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    install_error_handlers(app)
    def overload(headers) -> APIError | None:
        error = serving.refusal(headers)
        if error is not None:
            metrics.overloaded(getattr(error, "api_key", None))
        return error

    app.add_middleware(RequestGuard, api_key=options.api_keys, max_body_bytes=options.max_request_bytes,
                       on_reject=metrics.reject, allowed_hosts=host_check_for(options.host, options.allowed_hosts),
                       overload=overload)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving

    def counted(handler):
        async def endpoint(raw: Request):
            try:
                return await handler(serving, raw)
            except APIError as exc:
                if exc.status == 429:
                    metrics.overloaded(getattr(exc, "api_key", None))
                elif 400 <= exc.status < 500:
                    metrics.reject()
                raise
        return endpoint

    app.add_api_route("/v1/completions", counted(routes.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", counted(routes.chat_completions), methods=["POST"])
    app.add_api_route("/v1/responses", counted(routes.responses), methods=["POST"])
    app.add_api_route("/generate", counted(routes.generate), methods=["POST"])
    app.add_api_route("/v1/embeddings", counted(embeddings.embeddings), methods=["POST"])
    app.add_api_route("/tokenize", counted(utility.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", counted(utility.detokenize), methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", counted(lora_updates.load_lora_adapter), methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", counted(lora_updates.unload_lora_adapter), methods=["POST"])

    card = {"id": name, "object": "model", "created": created, "owned_by": "stagewise", "root": name,
            "max_model_len": serving.max_model_len}

    def cards() -> dict[str, dict]:
        """LoRA adapters are models of their own whose parent is the base model, as vLLM lists them
        (read each time: runtime loads and unloads show at once)."""
        return {name: card, **{a: {**card, "id": a, "root": a, "parent": name} for a in serving.lora_names}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": list(cards().values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in (known := cards()):
            raise APIError(f"The model {model_id[:200]!r} does not exist on this server; it serves {name!r} "
                           f"(see GET /v1/models).", 404, None, "model_not_found")
        return known[model_id]

    @app.get("/health")
    async def health():
        status, body = _health(engine)
        return JSONResponse(body, status_code=status)

    hosts = host_check_for(options.host, options.allowed_hosts)

    def health_fast(host: str | None) -> tuple[int, bytes] | None:
        """/health answered in the HTTP protocol itself (http11.py): None where the guard would refuse."""
        if hosts is not None and not host_allowed(host, hosts):
            return None
        status, body = _health(engine)
        return status, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

    app.state.health_fast = health_fast

    @app.get("/version")
    async def version():
        return utility.version()

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return utility.ping(engine.is_healthy, engine.unhealthy_reason)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _health(engine: EngineClient) -> tuple[int, dict]:
    """/health's status and body: 200 while the engine runs, else 503 saying why (recovering, dead,
    shutting down); where a pipeline across nodes runs."""
    if engine.is_healthy:
        return 200, {"status": "ok", **_stalled(engine), **_pipeline(engine.snapshot)}
    body = APIError(f"Unhealthy: {engine.unhealthy_reason}", 503, None, None, "service_unavailable").body()
    if engine.recovering and not engine.dead:
        body["status"] = "recovering"
    return 503, {**body, **_pipeline(engine.snapshot)}


def _stalled(engine: EngineClient) -> dict:
    """While the engine has sent nothing for seconds with requests open (a long step, a stage waiting
    on its disk): how long. Still 200: a long compile or prefill looks the same and must not get the
    server taken out of rotation; the field says the engine is not answering now."""
    quiet = engine.stalled_s
    if quiet is None:
        return {}
    return {"engine_stalled_s": round(quiet, 1),
            "engine_stalled": f"The engine has sent nothing for {quiet:.0f} s while requests are open (a long step, "
                              f"or a stage waiting on storage)."}


def _pipeline(snapshot: dict) -> dict:
    """Where a pipeline across nodes runs now and its last move (join, leave, loss), from the
    engine's latest stats (no call into the engine: /health stays instant)."""
    r = snapshot.get("recovery") or {}
    if len(r.get("nodes") or []) < 2 and not r.get("moves") and not r.get("standby"):
        return {}
    keys = ("nodes", "standby", "layout", "partition", "moves", "last_move")
    return {"pipeline": {k: r.get(k) for k in keys}}


def run_server(config: EngineConfig, options: ServerOptions | None = None, *, log_level: str = "info") -> None:
    """Build the engine (blocking: loads and captures), then serve until SIGINT/SIGTERM."""
    options = options or ServerOptions()
    from .shutdown import DrainingServer
    engine = EngineClient(config)      # blocks while the engine loads and captures
    try:
        app = build_app(engine, options, limits_of(config.limits))
        uv_config = uvicorn_config(app, options.host, options.port, log_level)
        freeze_heap()          # this process's own: what it loaded leaves the collector's scans
        DrainingServer(uv_config, engine, options.graceful_timeout_s).run()
    finally:
        engine.stop()          # a no-op after the lifespan hook; needed if uvicorn failed to start



def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info"):
    """How `stagewise serve` runs uvicorn (tests that serve an app in a thread use it too)."""
    import uvicorn

    from .http11 import JSONErrorsH11Protocol
    fast = getattr(app.state, "health_fast", None)
    protocol = JSONErrorsH11Protocol if fast is None else \
        type("StagewiseH11Protocol", (JSONErrorsH11Protocol,), {"health_fast": staticmethod(fast)})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=BACKSTOP_SHUTDOWN_S, http=protocol)
