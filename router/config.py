"""Router and launcher configuration: frozen dataclasses validated at construction,
and the one definition of the router's flags.

A field that ``shardserve launch`` sets carries its flag (:class:`Flag`: help, unit,
type, choices) in its metadata; ``router/cli.py`` builds the flags from them, each with
its field's default, as the shards' flags come from :class:`shard.config.ShardConfig`. So
every default is written once, here. Environment variables with the ``SHARDSERVE_``
prefix are read in two places only, both at call time: every flag's
``SHARDSERVE_<FLAG>`` by ``router.cli.apply_env_defaults``, and the cache folder by
:func:`shard.config.default_cache_dir`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shard.config import ENV_PREFIX, ShardConfig, size_arg


def env_default(name: str, default: str | None = None) -> str | None:
    """Value of ``SHARDSERVE_<NAME>`` if set, else ``default``.

    The only place the router reads the environment, so that importing a module never
    depends on it.
    """
    return os.environ.get(ENV_PREFIX + name.upper(), default)


@dataclass(frozen=True)
class Flag:
    """The ``shardserve launch`` flag of one config field (``router/cli.py`` adds it,
    with the field's default).

    Attributes:
        help: What the flag sets; ``--help`` appends the default, the choices and the
            environment variable.
        metavar: The value's unit or kind in ``--help``: SECONDS, TOKENS, N, PORT, SIZE
            (bytes, or with a unit) ...; none for flags with choices.
        name: The flag's spelling; default ``--`` and the field's name with ``-`` for
            ``_``, less a ``_s`` unit suffix (``placement_timeout_s`` →
            ``--placement-timeout``).
        aliases: Other spellings of the flag (vLLM's names of the same setting).
        type: Converts the command line's text; ``bool``: the flag takes ``on`` / ``off``.
        choices: The values allowed.
        nargs: argparse's ``nargs`` (``"+"``: one or more values, a tuple in the field).
        default_text: The default in words, for a flag that defaults to none, the value
            then being derived at start-up (from the model, the device, the KV cache).
        secret: ``--help`` says whether it is set, never its value.
    """

    help: str
    metavar: str | None = None
    name: str | None = None
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] = str
    choices: tuple[Any, ...] | None = None
    nargs: str | None = None
    default_text: str | None = None
    secret: bool = False

    def spelling(self, field_name: str) -> str:
        """The flag's main spelling for field ``field_name``."""
        return self.name or "--" + field_name.removesuffix("_s").replace("_", "-")


def _flag(help: str, **kwargs: Any) -> Any:
    """Metadata of a config field that ``shardserve launch`` sets: its :class:`Flag`."""
    return {"flag": Flag(help, **kwargs)}


def config_flags(config_class: type) -> dict[str, tuple[Flag, Any]]:
    """Field name → (its :class:`Flag`, its default) for each field of ``config_class``
    (a config dataclass) that is a flag, in the order of the fields."""
    flags: dict[str, tuple[Flag, Any]] = {}
    for spec in dataclasses.fields(config_class):
        if "flag" in spec.metadata:
            default = spec.default
            if default is dataclasses.MISSING and spec.default_factory is not dataclasses.MISSING:
                default = spec.default_factory()
            flags[spec.name] = (spec.metadata["flag"], default)
    return flags


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
            batch, in the same forward (a mixed step; Sarathi-Serve's stall-free
            batching, vLLM's V1 scheduler): the running batch gets its blocks first and
            the prompt chunks fill the budget left (``itl_target_s``). Off: prefill
            steps prefill only and the running batch decodes once nothing more can be
            admitted, or after ``max_waiting_tokens`` prefill steps in a row (the
            prefill-first loop of vLLM's V0 scheduler): fewer decode steps, each over a
            larger batch, while running streams pause for the prefill steps (a chunked
            prompt's chunks included).
        itl_target_s: The time a mixed step aims at, seconds: its prompt tokens are as
            many as the measured step time allows (:mod:`router.prefill_budget`), so
            that running streams' inter-token gap stays near it. None: 3 decode steps,
            at least 0.1 s.
        num_speculative_tokens: Guesses a speculative decode step verifies per request
            (the shards' ``--speculative-method`` proposes them); 0 = off.
        speculative_disable_batch_size: Decode steps of more requests than this run
            without speculation (verifying guesses costs compute a large batch lacks).
        steps_in_flight: Shard steps sent ahead of the one whose tokens the router is
            reading (overlapped scheduling). 1: step N+1 is sent before step N's
            tokens are read, and a request that stops at step N leaves at N+1. 2 gives
            the router a whole step of slack at the cost of a second discarded token.
    """

    # The derived budgets' flags default to none: derive_budgets fills them in from the
    # model, the device and the KV cache at start-up; these defaults serve code and tests.
    max_batch_prefill_tokens: int = field(default=4096, metadata=_flag(
        "prompt tokens per prefill step, the chunk of chunked prefill", type=int,
        metavar="TOKENS",
        default_text="512 on CPU (at most max-input-tokens + 1), 16384 on GPU; "
                     "max-input-tokens with --chunked-prefill off"))
    max_batch_size: int = field(default=64, metadata=_flag(
        "requests in the running batch", type=int, metavar="N", aliases=("--max-num-seqs",),
        default_text="64 on CPU; on GPU one per 1024 tokens the KV cache holds, 64-512"))
    max_input_tokens: int = field(default=2048, metadata=_flag(
        "longest prompt", type=int, metavar="TOKENS", default_text="max-total-tokens - 1"))
    max_total_tokens: int = field(default=4096, metadata=_flag(
        "longest prompt + output", type=int, metavar="TOKENS", aliases=("--max-model-len",),
        default_text="min(context, 4096, KV capacity)"))
    max_concurrent_requests: int = field(default=128, metadata=_flag(
        "queued + running requests; more are refused with 429", type=int, metavar="N",
        default_text="2 x max-batch-size, at least 128"))
    waiting_served_ratio: float = field(default=0.3, metadata=_flag(
        "while a batch runs, prefill newcomers once there are this many per running "
        "request ...", type=float, metavar="RATIO", default_text="0.3 on CPU, 0 on GPU"))
    max_waiting_tokens: int = field(default=20, metadata=_flag(
        "... or after this many decode steps since the last prefill", type=int,
        metavar="STEPS"))
    prefix_caching: bool = field(default=True, metadata=_flag(
        "reuse KV blocks of identical prompt prefixes", type=bool))
    chunked_prefill: bool = field(default=True, metadata=_flag(
        "split long prompts over steps shared with decodes", type=bool))
    decode_during_prefill: bool = field(default=True, metadata=_flag(
        "on: a step that prefills newcomers also decodes the running batch, in one "
        "forward; off: prefill "
        "first, the running batch decodes when nothing more can be admitted or after "
        "--max-waiting-tokens prefill steps in a row (running streams pause during "
        "prefills)", type=bool))
    itl_target_s: float | None = field(default=None, metadata=_flag(
        "time to aim at for a step that prefills while requests decode: its prompt "
        "tokens are sized from measured step times so that running streams' "
        "inter-token gap stays near it (at most --max-batch-prefill-tokens; mixed steps "
        "only: unused with --decode-during-prefill off)", type=float,
        metavar="SECONDS", default_text="3 decode steps, at least 0.1"))
    num_speculative_tokens: int = field(default=0, metadata=_flag(
        "guesses a speculative decode step verifies per request (--speculative-method); "
        "each costs compute, and a step that accepts more emits more tokens", type=int,
        metavar="TOKENS",
        default_text="3 with --speculative-method ngram, 4 with a draft model, else 0"))
    speculative_disable_batch_size: int = field(default=32, metadata=_flag(
        "decode steps of more running requests than this run without speculation",
        type=int, metavar="N", default_text="4 on CPU, 32 on GPU"))
    steps_in_flight: int = field(default=1, metadata=_flag(
        "shard steps sent ahead of the one being read: 1, or 2 for more slack on a busy "
        "router (a stopped request then computes two discarded tokens instead of one)",
        type=int, choices=(1, 2)))

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
        if self.num_speculative_tokens < 0:
            raise ValueError("--num-speculative-tokens must be >= 0")
        if self.speculative_disable_batch_size < 1:
            raise ValueError("--speculative-disable-batch-size must be positive")
        if self.steps_in_flight not in (1, 2):
            raise ValueError("--steps-in-flight must be 1 or 2")
        if self.waiting_served_ratio < 0:
            raise ValueError("--waiting-served-ratio must be >= 0")
        if self.max_waiting_tokens < 0:
            raise ValueError("--max-waiting-tokens must be >= 0")
        if self.itl_target_s is not None and not self.itl_target_s > 0:
            raise ValueError("--itl-target must be positive (seconds)")
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError("--max-input-tokens must be smaller than --max-total-tokens")
        if not self.chunked_prefill and self.max_input_tokens > self.max_batch_prefill_tokens:
            raise ValueError(
                "--max-input-tokens must not exceed --max-batch-prefill-tokens "
                "when chunked prefill is off (a prompt is prefilled in one step)"
            )


# Running requests above which decode steps do not speculate, when
# --speculative-disable-batch-size is not given. On a 2-core CPU a verify step of 8
# requests with 3 guesses each cost 1.3-1.5x a decode step: open chat at batch 8 ran at
# 0.87x with speculation (limit 32), 1.03x with the limit at 4; input-grounded prompts
# 1.94x at batch 1 (benchmarks/results/speculative-cpu.md). A GPU reads its weights
# once for all the rows of a step, so its verify steps cost about a decode step up to
# much larger batches.
SPECULATIVE_DISABLE_BATCH_SIZE = {"cpu": 4, "cuda": 32}
# Guesses per speculative step when --num-speculative-tokens is not given, per
# --speculative-method.
SPECULATIVE_TOKENS = {"none": 0, "ngram": 3, "draft": 4}
# Most guesses per request and step: warm-up captures decode CUDA graphs of up to
# --speculative-disable-batch-size × (k + 1) rows for the verify steps, and the gain
# levels off long before (H100, 8B-shaped model, guesses accepted at 0.7: 2.45× at k = 4,
# 2.75× at 7 at batch 1; benchmarks/results/speculative-gpu.md).
MAX_SPECULATIVE_TOKENS = 16


def speculative_tokens(given: int | None, method: str) -> int:
    """``--num-speculative-tokens`` as given, or its default for ``method``.

    Raises:
        ValueError: guesses asked for without a ``--speculative-method``, none (0) with
            one, or more than :data:`MAX_SPECULATIVE_TOKENS`.
    """
    if given is None:
        return SPECULATIVE_TOKENS[method]
    if given > 0 and method == "none":
        raise ValueError("--num-speculative-tokens needs --speculative-method (ngram) or "
                         "--speculative-model")
    if method != "none" and not 1 <= given <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens {given}: give 1 to "
                         f"{MAX_SPECULATIVE_TOKENS} guesses with --speculative-method "
                         f"{method} (leave the method out to decode without speculation)")
    return given


# Prompt tokens per prefill step when --max-batch-prefill-tokens is not given and chunked
# prefill is on: the most of one step. While requests decode, a step's prompt tokens are
# fewer, sized by --itl-target (router/prefill_budget.py); this bound is what a step
# takes when nothing decodes (a burst of arrivals on an idle server). On a GPU, 16384
# (nano-vllm's and SGLang's large-GPU budget; vLLM takes 8192): on the H200 it gave
# +6% over 2048 at 512 x 1024 prompt tokens (benchmarks/results/gpu-serving-h200.md).
# A CPU computes a step tens of times slower and takes 512.
PREFILL_CHUNK_TOKENS = {"cpu": 512, "cuda": 16384}
# Running batch on a GPU when --max-batch-size is not given: one request per this many
# tokens of KV capacity (the requests of the batch then hold 1024 tokens each on
# average without preemption; the scheduler preempts when they hold more) ...
GPU_BATCH_KV_TOKENS = 1024
# ... within these bounds (the decode CUDA graphs are captured up to the upper one; vLLM
# runs 256-1024 sequences on large GPUs, nano-vllm 512); a CPU runs 64.
GPU_BATCH_SIZE = (64, 512)
CPU_BATCH_SIZE = 64
# Waiting requests per running one before newcomers are admitted into a running batch
# (TGI's --waiting-served-ratio, 0.3): on a GPU 0, every step admits what fits, since a
# mixed step carries newcomers' prompts beside the running batch at little cost to it
# (measured in benchmarks/results/gpu-serving-h200.md: 0 with the tuned flags of run 8).
WAITING_SERVED_RATIO = {"cpu": 0.3, "cuda": 0.0}
# Queued + running requests before 429, per request of the running batch (at least TGI's
# 128).
CONCURRENT_PER_BATCH_ROW = 2
MIN_CONCURRENT_REQUESTS = 128


def derive_budgets(
    given: dict[str, Any],
    max_position_embeddings: int,
    kv_capacity_tokens: int | None = None,
    chunked_prefill: bool = True,
    device_type: str = "cuda",
) -> dict[str, Any]:
    """Budgets from flags, filling unset ones (``None``) from the model, the device and
    memory.

    Defaults: ``max_total_tokens`` = min(max_position_embeddings, 4096, KV capacity);
    ``max_input_tokens`` = max_total_tokens - 1; ``max_batch_prefill_tokens`` =
    ``PREFILL_CHUNK_TOKENS[device_type]`` with chunked prefill (512 on CPU, at most
    max_input_tokens + 1; 16384 on GPU, whatever the longest prompt); without chunked
    prefill, max_input_tokens (a prompt is prefilled in one step). ``max_batch_size``:
    64 on CPU; on GPU the KV capacity / ``GPU_BATCH_KV_TOKENS`` within
    ``GPU_BATCH_SIZE`` (the upper bound before the capacity is known, which sizes the
    decode CUDA graphs). ``waiting_served_ratio``: ``WAITING_SERVED_RATIO[device_type]``.
    ``max_concurrent_requests``: ``CONCURRENT_PER_BATCH_ROW`` × max_batch_size, at least
    ``MIN_CONCURRENT_REQUESTS``. ``speculative_disable_batch_size``:
    ``SPECULATIVE_DISABLE_BATCH_SIZE[device_type]``.

    Args:
        given: ``max_total_tokens``, ``max_input_tokens``, ``max_batch_prefill_tokens``,
            ``max_batch_size``, ``waiting_served_ratio``, ``max_concurrent_requests``,
            ``speculative_disable_batch_size`` as passed on the command line (``None`` or
            missing = derive).
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
    # NOTE: not bounded by the longest prompt on a GPU: a step carries several prompts
    prefill = given.get("max_batch_prefill_tokens") or (
        (min(inputs + 1, chunk) if device_type == "cpu" else chunk) if chunked_prefill
        else inputs
    )
    batch = given.get("max_batch_size")
    if batch is None:
        low, high = GPU_BATCH_SIZE
        batch = (CPU_BATCH_SIZE if device_type == "cpu" else high if kv_capacity_tokens is None
                 else min(max(kv_capacity_tokens // GPU_BATCH_KV_TOKENS, low), high))
    ratio = given.get("waiting_served_ratio")
    if ratio is None:
        ratio = WAITING_SERVED_RATIO.get(device_type, WAITING_SERVED_RATIO["cuda"])
    concurrent = given.get("max_concurrent_requests") or max(
        CONCURRENT_PER_BATCH_ROW * batch, MIN_CONCURRENT_REQUESTS)
    speculative = given.get("speculative_disable_batch_size") or (
        SPECULATIVE_DISABLE_BATCH_SIZE.get(device_type, SPECULATIVE_DISABLE_BATCH_SIZE["cuda"]))
    return {"max_total_tokens": total, "max_input_tokens": inputs,
            "max_batch_prefill_tokens": prefill, "max_batch_size": batch,
            "waiting_served_ratio": ratio, "max_concurrent_requests": concurrent,
            "speculative_disable_batch_size": speculative}


@dataclass(frozen=True)
class ValidationLimits:
    """Limits on request parameters, enforced before a request reaches a shard.

    Attributes:
        max_stop_sequences: Stop strings per request (OpenAI's limit, 4).
        max_stop_sequence_chars: Characters per stop string.
        max_top_n_tokens: Alternatives per generated token (``top_n_tokens``,
            ``logprobs``, ``top_logprobs``): OpenAI's limit, 20. The shard's sampler
            takes the top k of the step's logprobs, any k.
        max_best_of: Sequences per request (``best_of``, ``n``). Each decodes as a row of
            the running batch, so 16 lets one request take at most a quarter of the
            default batch (64 rows); OpenAI accepts up to 128 and vLLM sets no limit,
            TGI's default is 2.
    """

    max_stop_sequences: int = field(default=4, metadata=_flag(
        "stop strings per request", type=int, metavar="N"))
    max_stop_sequence_chars: int = 256
    max_top_n_tokens: int = field(default=20, metadata=_flag(
        "alternatives per token (top_n_tokens, logprobs, top_logprobs)", type=int,
        metavar="N"))
    max_best_of: int = field(default=16, metadata=_flag(
        "sequences per request (best_of, n)", type=int, metavar="N"))


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``shardserve launch`` needs.

    ``shard`` is what every rank is started with (``world_size`` = ``--num-shard``);
    each rank's copy gets its rank and the rendezvous from the executor.
    """

    shard: ShardConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: ValidationLimits = field(default_factory=ValidationLimits)
    host: str = field(default="0.0.0.0", metadata=_flag(
        "interface of the HTTP and gRPC APIs", metavar="HOST"))
    port: int = field(default=3000, metadata=_flag("HTTP port", type=int, metavar="PORT"))
    grpc_port: int = field(default=3001, metadata=_flag(
        "port of the public gRPC API (0 = off)", type=int, metavar="PORT"))
    executor: str = field(default="ray", metadata=_flag(
        "start shards as Ray actors or local processes", choices=("ray", "local")))
    ray_address: str | None = field(default=None, metadata=_flag(
        "join this Ray cluster (e.g. auto, or HEAD_IP:6379)", metavar="ADDRESS",
        default_text="start a local Ray instance"))
    placement: str = field(default="pack", metadata=_flag(
        "Ray placement of the ranks: pack onto few nodes, or one per node",
        choices=("pack", "spread")))
    placement_timeout_s: float = field(default=300.0, metadata=_flag(
        "seconds to wait for the Ray placement group (what is missing is logged every "
        "10 s), then exit with an error", type=float, metavar="SECONDS"))
    graceful_timeout_s: int = field(default=30, metadata=_flag(
        "seconds running requests may take to finish after SIGTERM", type=int,
        metavar="SECONDS"))
    max_request_bytes: int = field(default=1 << 20, metadata=_flag(
        "largest HTTP request body and public gRPC message: bytes or with a unit (413 / "
        "RESOURCE_EXHAUSTED beyond)", type=size_arg, metavar="SIZE"))
    max_restarts: int = field(default=3, metadata=_flag(
        "restarts of the shard group after a rank dies, then exit", type=int, metavar="N"))
    # Deadline of Prefill/Decode calls; 0 = adaptive (router/step_deadline.py).
    step_timeout_s: float = field(default=0.0, metadata=_flag(
        "seconds a prefill or decode step may take before its shard group counts as hung "
        "and is restarted (0 = adaptive: max(30, 10 x the slowest step seen, Warmup "
        "included))", type=float, metavar="SECONDS"))
    master_port: int = field(default=0, metadata=_flag(
        "torch.distributed rendezvous port on rank 0 (0 = a free one)", type=int,
        metavar="PORT"))
    # Token budgets as given on the command line (None = derive; see derive_budgets).
    budget_flags: dict[str, Any] = field(default_factory=dict)
    # Names the model answers to (OpenAI ``model``); the first is the reported one.
    # Empty = the shard's model id.
    served_model_names: tuple[str, ...] = field(default=(), metadata=_flag(
        "names the model answers to in the OpenAI `model` field (another is a 404); the "
        "first is reported by /info, /v1/models and responses", name="--served-model-name",
        nargs="+", metavar="NAME", default_text="the folder's name or the repository id"))
    # Bearer key HTTP (but /health, /metrics) and public gRPC calls need; None = open.
    api_key: str | None = field(default=None, repr=False, metadata=_flag(
        "require `Authorization: Bearer <key>` on every HTTP route but /health and "
        "/metrics, and the same gRPC metadata on every public gRPC call but health "
        "checks; none = the APIs are open", metavar="KEY", secret=True))
    metrics_require_api_key: bool = field(default=False, metadata=_flag(
        "on: /metrics needs the --api-key too (off: open to scrapers, as in vLLM and TGI)",
        type=bool))
    header_timeout_s: float = field(default=10.0, metadata=_flag(
        "seconds a client has to send a request's headers, and again its body; slower or "
        "idle connections are closed", type=float, metavar="SECONDS"))
    status_interval_s: float = field(default=5.0, metadata=_flag(
        "while busy, log throughput, running/waiting requests and KV cache use this often "
        "(0 = never)", type=float, metavar="SECONDS"))
    # API processes beside the engine's (router/api/process.py); None = derived.
    api_server_count: int | None = field(default=None, metadata=_flag(
        "processes serving the HTTP and gRPC APIs beside the engine's process, which then "
        "only schedules and steps the shards; 0 = the APIs run in the engine's process",
        type=int, metavar="N", default_text="1 when the shards run on a GPU, 0 on CPU"))

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
