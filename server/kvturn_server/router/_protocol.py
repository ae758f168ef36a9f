"""uvicorn's HTTP protocols with OpenAI-shaped answers to requests it cannot parse.

A request whose request line or headers do not parse never reaches the ASGI app: uvicorn
answers it itself, with a plain-text 400. Clients of an OpenAI-compatible endpoint read errors
as ``{"error": {...}}``, so the router's protocols answer those in that shape (same status,
same ``connection: close``).
"""

from __future__ import annotations

from typing import Any

from kvturn_server.router._errors import error_body


def _body(msg: str) -> bytes:
    return error_body(f"malformed HTTP request: {msg}", code="bad_request")


def httptools_protocol() -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body = _body(msg)
            content = [STATUS_LINE[400]]
            for name, value in self.server_state.default_headers:
                content.extend([name, b": ", value, b"\r\n"])
            content += [b"content-type: application/json\r\n",
                        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                        b"connection: close\r\n", b"\r\n", body]
            self.transport.write(b"".join(content))
            self.transport.close()

    return Protocol


def h11_protocol() -> type[Any]:
    import h11
    from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

    class Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = _body(msg)
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode("ascii")),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers,
                                       reason=STATUS_PHRASES[400]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol
