"""Image downloads for http(s) image URLs, which cannot be steered or stalled: every hop (the URL
and each redirect) must name a host of the allow-list, its address must be a public one unless the
operator allowed a loopback name or an address literal, the connection goes to the address that was
checked (no second lookup for a rebinding DNS answer), and the whole download, redirects included,
has one deadline and one byte cap. Every failure is one sentence naming the first URL's host only:
nothing of what a remote answered reaches the client (no oracle for internal addresses)."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse

from .limits import ImageError, ImageLimits

MAX_REDIRECTS = 3
CHUNK = 64 << 10
REDIRECTS = (301, 302, 303, 307, 308)


def fetch(url: str, limits: ImageLimits, where: str = "image") -> bytes:
    """The body of an allowed http(s) URL, within `limits.fetch_timeout_s` and `limits.max_image_bytes`."""
    first = (urllib.parse.urlsplit(url).hostname or "").lower()
    _check_host(first, limits, where, redirected=False)
    deadline = time.monotonic() + limits.fetch_timeout_s
    for hop in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https"):
            raise ImageError(f"{where} redirects to a URL that is not http(s); this server follows none.", where)
        _check_host(host, limits, where, redirected=hop > 0)
        try:
            status, location, body = _get(parts, _addresses(host, parts, where), deadline, limits, where)
        except ImageError:
            raise
        except (OSError, http.client.HTTPException, ValueError):
            raise _failed(where, first, limits) from None
        if status in REDIRECTS and location:
            url = urllib.parse.urljoin(url, location)
            continue
        if status != 200:
            raise _failed(where, first, limits)
        return body
    raise ImageError(f"{where} redirects more than {MAX_REDIRECTS} times; give the image's own URL.", where)


def _check_host(host: str, limits: ImageLimits, where: str, redirected: bool) -> None:
    if host in limits.allowed_hosts:
        return
    if redirected:
        raise ImageError(f"{where} redirects to a host that --allowed-image-hosts does not name; this server "
                         f"follows redirects only to allowed hosts.", where)
    raise ImageError(f"{where} is a remote URL (host {host[:100]!r}); this server fetches no remote images unless "
                     f"--allowed-image-hosts names the host, so send the image as a data URL.", where)


def _failed(where: str, host: str, limits: ImageLimits) -> ImageError:
    # NOTE: one sentence whatever went wrong (refused, reset, 404, 500, slow): what the remote
    # answered must not reach the client
    return ImageError(f"{where} could not be fetched from {host[:100]} (an image of at most {limits.max_image_bytes} "
                      f"bytes within {limits.fetch_timeout_s:g} s, --image-fetch-timeout-s); send it as a data URL.",
                      where)


def _addresses(host: str, parts: urllib.parse.SplitResult, where: str) -> list[str]:
    """The addresses of `host` the fetch may connect to: public ones, or any where the operator named
    a loopback name or an address literal in --allowed-image-hosts (deliberately local)."""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        infos = []
    local_ok = host == "localhost" or _is_literal(host)
    found = list(dict.fromkeys(str(info[4][0]) for info in infos))
    allowed = [a for a in found if local_ok or _is_public(a)]
    if not found:
        raise ImageError(f"{where}'s host {host[:100]} could not be resolved; send the image as a data URL.", where)
    if not allowed:
        raise ImageError(f"{where}'s host {host[:100]} resolves to a private or loopback address, which this "
                         f"server does not fetch from; send the image as a data URL.", where)
    return allowed


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_global and not (mapped or ip).is_multicast


def _get(parts, addresses: list[str], deadline: float, limits: ImageLimits,
         where: str) -> tuple[int, str | None, bytes]:
    """(status, Location, body) of one GET to the first of `addresses` that answers, aborted at
    `deadline` wherever it is."""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn = _Pinned(parts.scheme == "https", parts.hostname or "", port, addresses, _left(deadline))
    # NOTE: a timer closes the socket at the deadline: per-read timeouts alone let a host that sends
    # a byte every few seconds hold the download for ever
    timer = threading.Timer(_left(deadline), conn.abort)
    timer.daemon = True
    timer.start()
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "stagewise"})
        resp = conn.getresponse()
        if resp.status in REDIRECTS or resp.status != 200:
            return resp.status, resp.getheader("Location"), b""
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
            raise _too_big(where, limits)
        body = bytearray()
        while chunk := resp.read1(CHUNK):
            body += chunk
            if len(body) > limits.max_image_bytes:
                raise _too_big(where, limits)
            _left(deadline)
        _left(deadline)           # the timer's shutdown reads as the end of the body
        return 200, None, bytes(body)
    finally:
        timer.cancel()
        conn.close()


def _too_big(where: str, limits: ImageLimits) -> ImageError:
    return ImageError(f"{where} is over the limit of {limits.max_image_bytes} bytes (--max-image-bytes).", where)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the download's deadline passed")
    return left


class _Pinned(http.client.HTTPSConnection):
    """An HTTP(S) connection to addresses already checked (the first that answers), with the URL's
    name as Host (and SNI)."""

    def __init__(self, tls: bool, host: str, port: int, addresses: list[str], timeout: float):
        self.tls_context = ssl.create_default_context() if tls else None
        super().__init__(host, port, timeout=timeout, context=self.tls_context)
        self.addresses = addresses
        self._lock = threading.Lock()

    def connect(self) -> None:
        error: OSError = ConnectionRefusedError("no address")
        for address in self.addresses:
            try:
                sock = socket.create_connection((address, self.port), self.timeout)
                break
            except OSError as exc:
                error = exc
        else:
            raise error
        with self._lock:
            ctx = self.tls_context
            self.sock = ctx.wrap_socket(sock, server_hostname=self.host) if ctx is not None else sock

    def abort(self) -> None:
        with self._lock:
            if self.sock is not None:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
