"""Router and launcher configuration: frozen dataclasses validated at construction.

Command-line flags (``router/cli.py``) map onto these; the shards' flags and their
defaults are defined once, with :class:`shard.config.ShardConfig`. Environment variables with the
``SHARDSERVE_`` prefix are read in two places only, both at call time: every flag's
``SHARDSERVE_<FLAG>`` by ``router.cli.apply_env_defaults``, and the cache folder by
:func:`shard.config.default_cache_dir`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from shard.config import ENV_PREFIX, ShardConfig


def env_default(name: str, default: str | None = None) -> str | None:
    """Value of ``SHARDSERVE_<NAME>`` if set, else ``default``.

    The only place the router reads the environment, so that importing a module never
    depends on it.
    """
    return os.environ.get(ENV_PREFIX + name.upper(), default)


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and batch budgets of the continuous-batching scheduler (units: tokens).

    Attributes:
        max_batch_prefill_tokens: Most prompt tokens computed by one ``Prefill``.
        max_batch_size: Most requests in the running batch.
        max_input_tokens: Longest accepted prompt.
        max_total_tokens: Longest prompt + generated sequence.
        max_concurrent_requests: Queued + running requests before HTTP 429.
        waiting_served_ratio: While a batch is running, waiting requests are prefilled
            once there are at least this many per running request ...
        max_waiting_tokens: ... or once the running batch has decoded this many steps
            since the last prefill (TGI's meaning of both).
        prefix_caching: Reuse KV blocks of identical prompt prefixes.
        chunked_prefill: Split prompts longer than the prefill budget over several
            steps (which also decode the running batch, unless
            ``decode_during_prefill`` is off).
        decode_during_prefill: A step that prefills newcomers also decodes the running
            batch (TGI's loop). Off: prefill steps prefill only and the running batch
            decodes once nothing more can be admitted, or after ``max_waiting_tokens``
            prefill steps in a row (the prefill-first loop of vLLM's V0 scheduler):
            fewer decode steps, each over a larger batch, while running streams pause
            for the prefill steps (a chunked prompt's chunks included).
        steps_in_flight: Shard steps sent ahead of the one whose tokens the router is
            reading (overlapped scheduling). 1: step N+1 is sent before step N's
            tokens are read, and a request that stops at step N leaves at N+1. 2 gives
            the router a whole step of slack at the cost of a second discarded token.
    """

    max_batch_prefill_tokens: int = 4096
    max_batch_size: int = 64
    max_input_tokens: int = 2048
    max_total_tokens: int = 4096
    max_concurrent_requests: int = 128
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    prefix_caching: bool = True
    chunked_prefill: bool = True
    decode_during_prefill: bool = True
    steps_in_flight: int = 1

    def __post_init__(self) -> None:
        for name in (
            "max_batch_prefill_tokens",
            "max_batch_size",
            "max_input_tokens",
            "max_total_tokens",
            "max_concurrent_requests",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.steps_in_flight not in (1, 2):
            raise ValueError("--steps-in-flight must be 1 or 2")
        if self.waiting_served_ratio < 0:
            raise ValueError("--waiting-served-ratio must be >= 0")
        if self.max_waiting_tokens < 0:
            raise ValueError("--max-waiting-tokens must be >= 0")
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError("--max-input-tokens must be smaller than --max-total-tokens")
        if not self.chunked_prefill and self.max_input_tokens > self.max_batch_prefill_tokens:
            raise ValueError(
                "--max-input-tokens must not exceed --max-batch-prefill-tokens "
                "when chunked prefill is off (a prompt is prefilled in one step)"
            )


# Prompt tokens per prefill step when --max-batch-prefill-tokens is not given and chunked
# prefill is on. A longer prompt runs as several chunks, each followed by a decode step
# of the running batch, so it delays running streams by one chunk's compute at a time
# instead of its whole prefill. GPUs take chunks of the size vLLM and SGLang default to
# for online serving (2048 tokens); a CPU computes a chunk several times slower, so it
# takes smaller ones.
PREFILL_CHUNK_TOKENS = {"cpu": 512, "cuda": 2048}


def derive_budgets(
    given: dict[str, int | None],
    max_position_embeddings: int,
    kv_capacity_tokens: int | None = None,
    chunked_prefill: bool = True,
    device_type: str = "cuda",
) -> dict[str, int]:
    """Token budgets from flags, filling unset ones (``None``) from the model and memory.

    Defaults: ``max_total_tokens`` = min(max_position_embeddings, 4096, KV capacity);
    ``max_input_tokens`` = max_total_tokens - 1; ``max_batch_prefill_tokens`` =
    min(max_input_tokens + 1, chunk) with chunked prefill, where chunk is
    ``PREFILL_CHUNK_TOKENS[device_type]`` (512 on CPU, 2048 on GPU); without chunked
    prefill, max_input_tokens (a prompt is prefilled in one step).

    Args:
        given: ``max_total_tokens``, ``max_input_tokens``, ``max_batch_prefill_tokens``
            as passed on the command line (``None`` = derive).
        max_position_embeddings: The model's context length, tokens.
        kv_capacity_tokens: Tokens the KV cache holds (known after Warmup).
        chunked_prefill: Whether long prompts may be split over steps.
        device_type: ``"cpu"`` or ``"cuda"``, the shards' device (from Info).

    Raises:
        ValueError: a given budget exceeds the model's context length (names the flag).
    """
    total = given.get("max_total_tokens")
    if total is not None and total > max_position_embeddings:
        raise ValueError(
            f"--max-total-tokens {total} exceeds the model's context length "
            f"(max_position_embeddings={max_position_embeddings})"
        )
    if total is None:
        total = min(max_position_embeddings, 4096, kv_capacity_tokens or 4096)
    inputs = given.get("max_input_tokens") or max(total - 1, 1)
    chunk = PREFILL_CHUNK_TOKENS.get(device_type, PREFILL_CHUNK_TOKENS["cuda"])
    prefill = given.get("max_batch_prefill_tokens") or (
        min(inputs + 1, chunk) if chunked_prefill else inputs
    )
    return {"max_total_tokens": total, "max_input_tokens": inputs,
            "max_batch_prefill_tokens": prefill}


@dataclass(frozen=True)
class ValidationLimits:
    """Limits on request parameters, enforced before a request reaches a shard."""

    max_stop_sequences: int = 4
    max_stop_sequence_chars: int = 256
    max_top_n_tokens: int = 5
    max_best_of: int = 2


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``shardserve launch`` needs.

    ``shard`` is what every rank is started with (``world_size`` = ``--num-shard``);
    each rank's copy gets its rank and the rendezvous from the executor.
    """

    shard: ShardConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: ValidationLimits = field(default_factory=ValidationLimits)
    host: str = "0.0.0.0"
    port: int = 3000
    grpc_port: int = 3001  # public gRPC API; 0 = off
    executor: str = "ray"
    ray_address: str | None = None
    placement: str = "pack"
    placement_timeout_s: float = 300.0  # wait for the Ray placement group, then fail
    graceful_timeout_s: int = 30
    max_request_bytes: int = 1 << 20
    max_restarts: int = 3  # shard-group restarts after a rank dies, then the server exits
    # Deadline of Prefill/Decode calls, seconds; 0 = adaptive (router/step_deadline.py).
    step_timeout_s: float = 0.0
    master_port: int = 0  # rank 0's torch.distributed port; 0 = a free one
    # Token budgets as given on the command line (None = derive; see derive_budgets).
    budget_flags: dict[str, int | None] = field(default_factory=dict)
    # Names the model answers to (OpenAI ``model``); the first is the reported one.
    # Empty = the shard's model id.
    served_model_names: tuple[str, ...] = ()
    # Bearer key HTTP (but /health, /metrics) and public gRPC calls need; None = open.
    api_key: str | None = field(default=None, repr=False)
    metrics_require_api_key: bool = False  # /metrics needs the api_key too
    header_timeout_s: float = 10.0  # to receive a request's headers (and its body), seconds
    status_interval_s: float = 5.0  # between status lines of a busy server; 0 = none
    # API processes beside the engine's (router/api_process.py); 0 = the APIs run in the
    # engine's process; None = 1 when the shards run on a GPU, else 0.
    api_server_count: int | None = None

    def __post_init__(self) -> None:
        if self.executor not in ("ray", "local"):
            raise ValueError("--executor must be 'ray' or 'local'")
        if self.graceful_timeout_s < 0:
            raise ValueError("--graceful-timeout must be >= 0")
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must be >= 0")
        if self.step_timeout_s < 0:
            raise ValueError("--step-timeout must be >= 0 (0 = adaptive)")
        if not 0 <= self.master_port < 65536:
            raise ValueError("--master-port must be in [0, 65535] (0 = a free port)")
        if self.placement not in ("pack", "spread"):
            raise ValueError("--placement must be 'pack' or 'spread'")
        if self.placement_timeout_s <= 0:
            raise ValueError("--placement-timeout must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in [0, 65535]")
        if not 0 <= self.grpc_port < 65536:
            raise ValueError("--grpc-port must be in [0, 65535] (0 = no gRPC API)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.metrics_require_api_key and self.api_key is None:
            raise ValueError("--metrics-require-api-key on needs --api-key")
        if self.header_timeout_s <= 0:
            raise ValueError("--header-timeout must be positive")
        if self.api_server_count is not None and self.api_server_count < 0:
            raise ValueError("--api-server-count must be >= 0")
        if self.status_interval_s < 0:
            raise ValueError("--status-interval must be >= 0 (0 = no status lines)")
        names = self.served_model_names
        if any(not name.strip() for name in names) or len(set(names)) != len(names):
            raise ValueError("--served-model-name: names must be non-empty and distinct")
