"""uvicorn's HTTP/1.1 protocol (h11) with two changes: a request it cannot parse (a malformed
request line or header, `Content-Length: abc`) is answered in the OpenAI error shape, like
every other error of this server, instead of uvicorn's plain-text 400; and a connection whose
first bytes are a whole `GET /health` is answered in the protocol (`Connection: close`), ahead of
every request task waiting on the event loop, so a burst of requests cannot make a load balancer
think the server dead. The answer comes from the app (`health_fast`): the same body as the route's,
or None (say a Host the guard refuses) to let the request take the ordinary way.
"""
from __future__ import annotations

import json
from http import HTTPStatus
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import bad_request

MALFORMED = ("The request is not valid HTTP/1.1 (a malformed request line or header, such as a Content-Length "
             "that is not a number); fix the request and retry.")


HEALTH = b"GET /health HTTP/1."
FastHealth = Callable[[str | None], "tuple[int, bytes] | None"]     # Host header -> (status, JSON body) or None


class JSONErrorsH11Protocol(H11Protocol):
    health_fast: FastHealth | None = None

    def data_received(self, data: bytes) -> None:
        if self.health_fast is not None and data.startswith(HEALTH) and data.endswith(b"\r\n\r\n") \
                and self.cycle is None and self.conn.their_state is h11.IDLE and self._answer_health(data):
            return
        super().data_received(data)

    def _answer_health(self, data: bytes) -> bool:
        lines = data[:-4].split(b"\r\n")
        hosts = [v.strip().decode("latin-1") for k, _, v in (line.partition(b":") for line in lines[1:])
                 if k.strip().lower() == b"host"]
        assert self.health_fast is not None
        answer = self.health_fast(hosts[0] if len(hosts) == 1 else None) if len(hosts) <= 1 else None
        if answer is None:
            return False
        status, body = answer
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, HTTPStatus(status).phrase.encode(),
                                                                  len(body), body))
        self.transport.close()
        return True

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(bad_request(MALFORMED, code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
