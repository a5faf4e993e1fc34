"""vLLM's runtime LoRA endpoints, in its request and response shapes: POST /v1/load_lora_adapter
(`{"lora_name", "lora_path"}`) and POST /v1/unload_lora_adapter (`{"lora_name"}`), served with
--enable-lora-runtime-updates (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING). Success is vLLM's plain
text; a refusal is one sentence in the OpenAI error shape (404 unknown name, 409 in use, else 400)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from ..core.client import ServerUnavailable
from ..errors import LoraInUseError, LoraNotFoundError
from .errors import APIError, ClientGone, bad_request
from .intake import parse_request
from .protocol import _Lenient
from .serving import Serving

MAX_PATH_CHARS = 4096


class LoadLoraAdapterRequest(_Lenient):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Lenient):
    lora_name: str
    lora_int_id: int | None = None      # vLLM's field; names alone identify adapters here


async def load_lora_adapter(serving: Serving, raw: Request) -> Response:
    req = await _parse(serving, raw, LoadLoraAdapterRequest)
    if not req.lora_path or len(req.lora_path) > MAX_PATH_CHARS:
        raise bad_request(f"lora_path must be 1 to {MAX_PATH_CHARS} characters.", "lora_path")
    await _update(serving, req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(serving: Serving, raw: Request) -> Response:
    req = await _parse(serving, raw, UnloadLoraAdapterRequest)
    await _update(serving, req.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _parse(serving: Serving, raw: Request, schema):
    if not serving.engine.info.lora_runtime_updates:
        raise APIError("Runtime LoRA updates are off on this server; start it with --enable-lora-runtime-updates.",
                       404, None, "not_found", "not_found_error")
    try:
        body = await serving.read_body(raw)
    except ClientGone:
        raise APIError("The client went away.", 499) from None
    return await serving.off_loop(parse_request, body, schema)


async def _update(serving: Serving, name: str, path: str | None) -> None:
    try:
        await serving.engine.update_lora(name, path, tuple(serving.accepted_names))
    except LoraNotFoundError as exc:
        raise APIError(str(exc), 404, "lora_name", "lora_not_found", "not_found_error") from None
    except LoraInUseError as exc:
        raise APIError(str(exc), 409, "lora_name", "lora_in_use") from None
    except ServerUnavailable as exc:
        raise APIError(str(exc), 503, None, None, "service_unavailable") from None
    except ValueError as exc:
        raise bad_request(str(exc), "lora_path" if path is not None else "lora_name") from None
