"""What every API layer needs: the engine, the validator and static model facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from router.api.offload import Offload
from router.engine.api import EngineApi
from router.validation import Validator


@dataclass
class ServerState:
    """Shared by the HTTP app and the public gRPC service.

    Attributes:
        engine: The engine (in this process), or its proxy in an API process.
        model_id: Name reported by /info, /v1/models, ModelInfo and OpenAI responses.
        device_type: "cpu" or "cuda".
        model_aliases: Further names the OpenAI routes accept in ``model``
            (``--served-model-name`` after the first).
        api_key: Bearer key every call needs (see router/api/auth.py); None = open.
        metrics_require_api_key: ``/metrics`` needs the key too (open by default).
        max_request_bytes: Largest HTTP body and public gRPC message, bytes.
        offload: Threads that tokenize and render chat templates off the event loop.
    """

    engine: EngineApi
    validator: Validator
    model_id: str
    dtype: str
    device_type: str
    num_shard: int
    attention_backend: str
    version: str
    max_request_bytes: int = 1 << 20
    quantization: str = "none"
    kv_cache_dtype: str = ""
    quantization_details: str = ""
    speculative_decoding: str = ""
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    metrics_require_api_key: bool = False
    offload: Offload = field(default_factory=Offload)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model is served as, the reported one first."""
        return (self.model_id, *self.model_aliases)


def server_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request`` (``create_app`` keeps it
    in ``app.state.server``)."""
    state: ServerState = request.app.state.server
    return state


async def _server_state_dependency(request: Request) -> ServerState:
    # a coroutine, so that FastAPI calls it on the event loop: a plain function
    # dependency goes through a worker thread for every request
    return server_state(request)


# A route parameter of this type receives the app's ServerState.
State = Annotated[ServerState, Depends(_server_state_dependency)]
