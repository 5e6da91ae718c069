"""``--api-key``: every HTTP route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` (what the ``openai`` package sends for ``api_key``);
``/metrics`` too with ``--metrics-require-api-key on``.

An ASGI middleware, so it answers before a body is read or a route runs. Keys are
compared in constant time. A refusal is 401 with ``WWW-Authenticate: Bearer`` and an
error body in the route's shape (OpenAI's under ``/v1/``, TGI's elsewhere).
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.errors import send_error

# Probes and scrapers must work without the key (by default: as in vLLM and TGI).
OPEN_PATHS = frozenset({"/health", "/metrics"})


def bearer_matches(header: str | bytes | None, api_key: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <api_key>`` (scheme in any case)."""
    if header is None:
        return False
    value = header.decode("latin-1") if isinstance(header, bytes) else header
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyAuth:
    """Refuse HTTP requests without ``Authorization: Bearer <api_key>`` (401), but
    those of ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if bearer_matches(headers.get(b"authorization"), self.api_key):
            await self.app(scope, receive, send)
            return
        await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        message = "missing or wrong API key: send the header Authorization: Bearer <key>"
        await send_error(send, scope["path"], 401, message, "authentication",
                         code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
