"""The gate in front of every route (pure ASGI middleware): the Host header (421), the API key
(401), the JSON content type of request bodies (415), the body size (413) and, for generation
requests, a full waiting queue (429), each answered in the OpenAI error shape before a route reads
anything: a refusal costs no routing, no request object, no exception.

415 matters even without a key: browsers send `text/plain` (and body-less content types)
cross-origin without a preflight, so a web page could otherwise make a local server generate.
The Host check stops DNS rebinding: a page whose name resolves to 127.0.0.1 reaches a server
bound to loopback as same-origin, but its requests carry the page's own name as Host.
"""
from __future__ import annotations

import hmac
import ipaddress
from typing import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, BodyTooLarge

OPEN_PATHS = ("/health", "/metrics")
BODY_METHODS = ("POST", "PUT", "PATCH")
# POST /ping (vLLM's, for SageMaker) reads no body and does nothing; the others take no POST at all
# (405 from the router, not 415 here)
BODILESS_PATHS = ("/ping", "/health", "/metrics", "/version", "/v1/models")
GENERATION_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate",
                              "/v1/embeddings"))


class RequestGuard:
    """`api_key`: one key or several (a tuple, one per tenant). `allowed_hosts`: None, no Host check;
    else the Host names accepted besides loopback names and addresses ('*': any)."""

    def __init__(self, app: ASGIApp, api_key: str | tuple[str, ...] | None, max_body_bytes: int,
                 on_reject=lambda: None, allowed_hosts: tuple[str, ...] | None = None,
                 overload: Callable[[Headers], APIError | None] = lambda headers: None):
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self.api_keys = tuple(k.encode() for k in keys if k)
        self.api_key = self.api_keys[0] if self.api_keys else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject          # counts the refusal (metrics)
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        self.overload = overload            # a generation request's 429 (counted by the callee), or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        error = self._check(scope, headers)
        if error is not None and error.status != 429:
            self.on_reject()
        if error is not None:
            response = error.response()
            if error.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        if scope["method"] in BODY_METHODS:
            receive = self._limited(receive)
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: Headers) -> APIError | None:
        if self.allowed_hosts is not None and not self._host_ok(headers.get("host")):
            shown = (headers.get("host") or "")[:100]
            return APIError(f"The Host {shown!r} is not a name of this server, which answers only loopback names "
                            f"here; use http://127.0.0.1 or localhost, or start it with --allowed-hosts NAME (for a "
                            f"reverse proxy).", 421, None, "misdirected_request")
        if self.api_key is not None and _needs_key(scope["path"]) and not self._authorized(headers):
            return APIError("Missing or incorrect API key; send it as the header 'Authorization: Bearer <key>'.",
                            401, None, "invalid_api_key")
        if scope["method"] not in BODY_METHODS or scope["path"] in BODILESS_PATHS \
                or scope["path"].startswith("/v1/models/"):
            return None
        if not _is_json(headers.get("content-type")):
            return APIError(f"Unsupported content type {headers.get('content-type', '(none)')[:100]!r}; send the "
                            f"body as JSON with 'Content-Type: application/json'.", 415, None,
                            "unsupported_media_type")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return BodyTooLarge(self.max_body_bytes)
        return self.overload(headers) if scope["path"] in GENERATION_PATHS else None

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # NOTE: compare_digest takes time independent of where the strings differ (no timing oracle).
        presented = token.strip().encode()
        # NOTE: every key is compared, so the time does not say which one matched
        matches = [hmac.compare_digest(presented, key) for key in self.api_keys]
        return scheme.lower() == "bearer" and any(matches)

    def _host_ok(self, host: str | None) -> bool:
        return host_allowed(host, self.allowed_hosts or ())

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that counts body bytes (chunked bodies have no Content-Length) and stops at the limit."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message
        return limited


KEYED_PATHS = ("/generate", "/tokenize", "/detokenize")


def host_allowed(host: str | None, allowed_hosts) -> bool:
    """A loopback name or address, or an allowed name; no Host (HTTP/1.0) is let through, as
    browsers always send one."""
    if host is None or "*" in allowed_hosts:
        return True
    name = host_name(host)
    return is_loopback_name(name) or name in allowed_hosts


def _needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and (path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS)


def host_name(host: str) -> str:
    """The name part of a Host header ('[::1]:8000' -> '::1', 'Example.com.:80' -> 'example.com'); a
    header that is not a name with an optional numeric port ('[::1]evil.com') is returned whole, so it
    never passes for a loopback name."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 and _is_port_suffix(host[end + 1:]) else host
    if host.count(":") == 1:
        name, port = host.split(":")
        return name.rstrip(".") if _is_port_suffix(":" + port) else host
    return host.rstrip(".")


def _is_port_suffix(text: str) -> bool:
    """'' or ':' and digits (RFC 9110 allows none)."""
    return text == "" or (text[:1] == ":" and text[1:].isascii() and (text[1:].isdigit() or not text[1:]))


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    # NOTE: ::ffff:127.0.0.1 is 127.0.0.1 (a dual-stack socket shows IPv4 peers so); ipaddress says not loopback
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def host_check_for(bind_host: str, allowed_hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The guard's `allowed_hosts`: checked when bound to loopback (or when names are given), else None."""
    if allowed_hosts is not None:
        return allowed_hosts
    return () if is_loopback_name(host_name(bind_host)) else None


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
