"""The streaming endpoints' response: server-sent events over Starlette's
:class:`~starlette.responses.StreamingResponse`, framed by sse-starlette.

Not sse-starlette's ``EventSourceResponse``: it wraps every write in a timeout scope and
runs keep-alive and shutdown watchers beside the stream, which cost 22% of the router's
CPU per decode step with 256 streams (``benchmarks/steps/router_step.py``; the router must
write one event per stream per step while the device computes the next). Like vLLM's
OpenAI server, no keep-alive comments are sent; a client that leaves is seen by
Starlette's disconnect watch and by :func:`router.api.generation.client_gone`.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping

from sse_starlette.event import ServerSentEvent
from starlette.responses import StreamingResponse

# sse-starlette's defaults: no caching, and no buffering by an nginx in front
HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response. Each ``str`` item of ``content`` becomes one
    event's data; ``bytes`` items are events already framed (several may be joined, see
    :func:`sse_events`) and are written as they are."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterable[str | bytes],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(_framed(content), status_code, {**HEADERS, **(headers or {})},
                         self.media_type)


def sse_events(lines: Iterable[str]) -> bytes:
    """Server-sent events, one per line of ``lines`` (framed by sse-starlette), as one
    body part: written at once, several events cost one write to the socket."""
    return b"".join(ServerSentEvent(data=line).encode() for line in lines)


async def _framed(content: AsyncIterable[str | bytes]) -> AsyncIterator[bytes]:
    async for item in content:
        yield item if isinstance(item, bytes) else sse_events((item,))
