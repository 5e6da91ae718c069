"""What every API layer needs: the engine, the validator and static model facts."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.api.offload import Offload
from router.engine import Engine
from router.validation import Validator


@dataclass
class ServerState:
    """Shared by the HTTP app and the public gRPC service.

    Attributes:
        model_id: Name reported by /info, /v1/models and ModelInfo.
        device_type: "cpu" or "cuda".
        max_request_bytes: Largest HTTP body and public gRPC message, bytes.
        offload: Threads that tokenize and render chat templates off the event loop.
    """

    engine: Engine
    validator: Validator
    model_id: str
    dtype: str
    device_type: str
    num_shard: int
    attention_backend: str
    version: str
    max_request_bytes: int = 1 << 20
    offload: Offload = field(default_factory=Offload)
