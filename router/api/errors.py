"""Error bodies in the shape of the route's API, for the route handlers and for the ASGI
middlewares that answer before a route runs (API key, body size).

- Under ``/v1/`` (OpenAI): ``{"error": {"message", "type", "param", "code"}}``, ``type``
  one of OpenAI's (``invalid_request_error``, ``rate_limit_error``, ``server_error``),
  as documented in OpenAI's API reference ("Error codes"); a 422 is answered as 400, as
  OpenAI does for a malformed request.
- Elsewhere (TGI): ``{"error": message, "error_type": kind}``, as TGI's ``ErrorResponse``.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Send

from router.api.schemas import ErrorResponse

# OpenAI's error ``type`` per HTTP status; any other status is a ``server_error``.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 404: "invalid_request_error", 405: "invalid_request_error",
                 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_error"}


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is one of the OpenAI-compatible routes (``/v1/...``)."""
    return path.startswith("/v1/")


def error_body(path: str, status: int, message: str, error_type: str,
               param: str | None = None, code: str | None = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body of an error on ``path``.

    Args:
        path: the request's URL path; chooses the shape.
        status: the HTTP status meant (a 422 on an OpenAI route is sent as 400).
        message: the human-readable error, naming the field where one is at fault.
        error_type: TGI's ``error_type`` (``validation``, ``overloaded``, ...).
        param: OpenAI's ``param``: the request field at fault, if any.
        code: OpenAI's ``code`` (e.g. ``invalid_api_key``), if any.
    """
    if is_openai_path(path):
        kind = _OPENAI_TYPES.get(status, "server_error")
        body: dict[str, Any] = {
            "error": {"message": message, "type": kind, "param": param, "code": code}}
        return (400 if status == 422 else status), body
    return status, ErrorResponse(error=message, error_type=error_type).model_dump()


async def send_error(send: Send, path: str, status: int, message: str, error_type: str,
                     param: str | None = None, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer an ASGI HTTP request with :func:`error_body`'s status and JSON body, plus
    ``headers``; for middlewares, before any route runs."""
    status, body = error_body(path, status, message, error_type, param, code)
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
