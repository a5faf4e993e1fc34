"""uvicorn's HTTP/1.1 protocol (h11) with one change: a request it cannot parse (a malformed
request line or header, `Content-Length: abc`) is answered in the OpenAI error shape, like
every other error of this server, instead of uvicorn's plain-text 400.
"""
from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import bad_request

MALFORMED = ("The request is not valid HTTP/1.1 (a malformed request line or header, such as a Content-Length "
             "that is not a number); fix the request and retry.")


class JSONErrorsH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = json.dumps(bad_request(MALFORMED, code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
