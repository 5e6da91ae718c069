"""Shard configuration: one frozen dataclass, validated at construction, and the one
definition of every shard flag.

Each :class:`ShardConfig` field carries its flag (:class:`ShardFlag`: spelling, help,
type, choices) in its metadata. From that one definition :mod:`shard.config_flags`
makes the command line of ``python -m shard.server``, the argv the local executor starts
a rank with, and the shard flags of ``shardserve launch``, so a default is written once.

This module is part of the router ↔ shard contract: it imports no torch (torch is
imported inside the two methods that resolve a device and a dtype), so the router can
import it. Environment variables (prefix ``SHARDSERVE_``) are read in two places only,
:func:`shard.config_flags.env_overrides` and :func:`default_cache_dir`, and only when
called — never at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

ENV_PREFIX = "SHARDSERVE_"


def default_cache_dir() -> Path:
    """Folder for converted models and warm-up tuning results: ``$SHARDSERVE_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/shardserve``, else ``~/.cache/shardserve``.

    Raises:
        RuntimeError: if neither variable is set and the home folder cannot be resolved.
    """
    configured = os.environ.get(ENV_PREFIX + "CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "shardserve"


MiB = 1024 * 1024

LoadFormat = Literal["safetensors", "dummy"]
LOAD_FORMATS = ("safetensors", "dummy")
DTYPES = ("float32", "bfloat16", "float16")
# Names of shard/attention's registry plus "auto" (tests/unit/router/test_cli.py checks
# that they agree; the registry itself imports torch).
ATTENTION_BACKENDS = ("auto", "triton", "flash_attn", "flashinfer", "torch")
# --quantization (vLLM's names): "none", or fp8 weights (shard/quantization/)
QUANTIZATIONS = ("none", "fp8")
# --kv-cache-dtype: "auto" (the model's dtype) or fp8 e4m3 (shard/kv_cache.py)
SPECULATIVE_METHODS = ("none", "ngram", "draft")
KV_CACHE_DTYPES = ("auto", "fp8")

# Size units: SI powers of 1000 and IEC powers of 1024 (Kubernetes' spelling: 2G = 2e9,
# 2Gi = 2GiB = 2 x 2**30); case does not matter, a trailing B is optional.
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*?)b?\s*", re.IGNORECASE)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def parse_size(text: str) -> int:
    """A size in bytes from ``text``: a number of bytes, or a number with a unit —
    ``512MiB`` (2**20), ``1GiB`` / ``1Gi`` (2**30), ``2G`` / ``2GB`` (10**9), ``64k`` —
    rounded down to whole bytes.

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with a unit "
                         "(K, M, G, T for powers of 1000; KiB, MiB, GiB, TiB for powers of 1024)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def size_arg(text: str) -> int:
    """argparse type of size flags (bytes, or with a unit: see :func:`parse_size`).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off, any case) as a bool.

    Raises:
        ValueError: none of those words.
    """
    word = text.strip().lower()
    if word not in _TRUE | _FALSE:
        raise ValueError("expected true/false (1/0, yes/no, on/off)")
    return word in _TRUE


@dataclass(frozen=True)
class ShardFlag:
    """The command-line flag of one :class:`ShardConfig` field.

    Attributes:
        help: What the flag sets (argparse help; ``shardserve launch`` appends the
            default, the choices and the environment variable).
        name: The flag's spelling; empty = ``--`` + the field name with dashes.
        type: Converts the flag's text to the field's value (a switch when ``bool``).
        choices: The accepted values, if only some are.
        metavar: The value's name in the help.
    """

    help: str
    name: str = ""
    type: Callable[[str], Any] = str
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None


def _flag(help: str, **kwargs: Any) -> Any:
    """Metadata of a :class:`ShardConfig` field: its :class:`ShardFlag`."""
    return {"flag": ShardFlag(help, **kwargs)}


@dataclass(frozen=True)
class ShardConfig:
    """Everything one shard needs to start.

    Attributes:
        model_path: Hugging Face model folder (config.json + safetensors). With
            ``load_format="dummy"`` only config.json is read.
        model_id: Name reported by ``Info``; defaults to ``model_path``.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``,
            ``"bfloat16"`` or ``"float16"``.
        device: ``"auto"`` (cuda if available, else cpu), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        load_format: ``"safetensors"`` reads the checkpoint; ``"dummy"`` fills
            random weights from config.json alone (benchmarks).
        quantization: ``"none"``, or ``"fp8"``: the decoder layers' linear weights in
            float8 e4m3 with per-output-channel scales, activations quantized per token
            (:mod:`shard.quantization`); needs CUDA compute capability 8.9+ (or CPU).
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"fp8"``: keys and values in
            float8 e4m3 with a scale per token and KV head (:mod:`shard.kv_cache`).
        world_size: Tensor-parallel world size.
        attention_backend: Registry name (see :mod:`shard.attention`), or ``"auto"``.
        cuda_graphs: Decode batch sizes captured as CUDA graphs at warmup: ``"auto"``
            (1, 2, 4, 8, then multiples of 16 up to the max batch size), ``"0"`` (off), or
            comma-separated sizes such as ``"1,2,4,8,16,32"``. CUDA only.
        pdl: Programmatic dependent launch of our Triton kernels (:mod:`shard.kernels.pdl`):
            ``"auto"`` (on where it runs: CUDA compute capability 9.0+) or ``"off"``.
        gemm_tuning: Prefill and decode-graph products through the cuBLASLt algorithm
            measured fastest at warm-up (:mod:`shard.kernels.gemm_tuning`): ``"auto"`` (on
            CUDA with bfloat16 or float16 weights) or ``"off"`` (cuBLAS's own pick
            everywhere).
        gemm_tuning_cache: Folder of the warm-up tuning results kept for later warm-ups
            (one file per GPU model and library versions); ``""`` = ``gemm-tuning`` under
            :func:`default_cache_dir`.
        block_size: Tokens per KV block; must suit the attention backend.
        kv_cache_bytes: KV cache budget on CPU, in bytes (all layers, K and V).
        gpu_memory_fraction: Fraction of total GPU memory the shard may use
            (weights + activations + KV cache), in (0, 1].
        json_logs: Log JSON lines instead of readable ones.
        rank: Tensor-parallel rank of this shard, in [0, world_size).
        master_addr: IP of rank 0, where the process group meets (world_size > 1).
        master_port: Free TCP port on ``master_addr`` for the rendezvous; 0 = unset
            (a rank of a group of several gets one from :meth:`for_rank`).
        step_trace_dir: Folder where each process of the launch (the router and every
            shard) appends its steps' timestamps, ``<pid>.tsv`` (:mod:`shard.step_trace`,
            read by ``benchmarks/steps/step_chain.py``); ``""`` = no tracing.
        parent_pid: The process that started this shard: once it is no longer the
            shard's parent (it exited, even by SIGKILL), the shard stops itself
            (``python -m shard.server`` only; see :func:`shard.server.watch_parent`).
            0 = no watch. The router's local executor sets its own pid.

    Raises:
        ValueError: on any invalid field, naming it.
    """

    model_path: str = field(metadata=_flag("Hugging Face model folder", name="--model"))
    model_id: str = field(default="", metadata=_flag(
        "name reported by Info (default: --model)"))
    dtype: str = field(default="auto", metadata=_flag(
        "weights and activations; auto = float32 on CPU, bfloat16 on GPU",
        choices=("auto", *DTYPES)))
    device: str = field(default="auto", metadata=_flag(
        "cpu, cuda, cuda:N or auto (cuda when available)"))
    load_format: LoadFormat = field(default="safetensors", metadata=_flag(
        "read the checkpoint, or random weights from config.json alone",
        choices=LOAD_FORMATS))
    quantization: str = field(default="none", metadata=_flag(
        "fp8: the decoder layers' weights in fp8 e4m3 with per-output-channel scales, "
        "activations quantized per token (quantized at load, or read from an FP8 checkpoint); "
        "a GPU of compute capability 8.9+ (Ada, Hopper) or the CPU",
        choices=QUANTIZATIONS))
    kv_cache_dtype: str = field(default="auto", metadata=_flag(
        "KV cache: auto (the model's dtype) or fp8 (e4m3 with a scale per token and KV head, "
        "about twice the tokens); a GPU of compute capability 8.9+ or the CPU",
        choices=KV_CACHE_DTYPES))
    speculative_method: str = field(default="none", metadata=_flag(
        "speculative decoding: ngram = prompt lookup (guess the tokens that followed the "
        "latest earlier occurrence of the last n tokens in prompt and output; no extra "
        "model); draft = a smaller model with the same tokenizer guesses "
        "(--speculative-model); guesses are verified in one forward, with exact greedy "
        "output and the target's distribution when sampling; none = off",
        choices=SPECULATIVE_METHODS))
    speculative_model: str = field(default="", metadata=_flag(
        "the draft model of --speculative-method draft (implied when given): a model "
        "folder, or ORG/NAME in the local Hugging Face cache, whose tokenizer is the "
        "served model's; it runs in every shard beside the served model, with its own KV "
        "cache in the same blocks", metavar="PATH"))
    ngram_max: int = field(default=4, metadata=_flag(
        "longest n-gram --speculative-method ngram matches (tried first)", type=int,
        metavar="TOKENS"))
    ngram_min: int = field(default=2, metadata=_flag(
        "shortest n-gram --speculative-method ngram matches", type=int,
        metavar="TOKENS"))
    world_size: int = field(default=1, metadata=_flag("tensor-parallel ranks", type=int))
    attention_backend: str = field(default="auto", metadata=_flag(
        "attention kernels; auto = the fastest that runs here (our Triton kernels, then "
        "flash-attn, FlashInfer on a GPU; PyTorch on CPU; the log and /info say why)",
        choices=ATTENTION_BACKENDS))
    cuda_graphs: str = field(default="auto", metadata=_flag(
        "decode batch sizes captured as CUDA graphs at warm-up: auto (1,2,4,8, then "
        "multiples of 16 up to --max-batch-size), 0 (off), or a list such as 1,2,4,8,16,32",
        metavar="SIZES"))
    pdl: str = field(default="auto", metadata=_flag(
        "programmatic dependent launch of our Triton kernels, each starting while the one "
        "before it finishes: auto (on where it runs: CUDA compute capability 9.0+) or off",
        choices=("auto", "off")))
    gemm_tuning: str = field(default="auto", metadata=_flag(
        "time cuBLASLt's algorithms for the prefill and decode-graph products at warm-up "
        "and run each through the fastest: auto (on a GPU, bfloat16/float16) or off",
        choices=("auto", "off")))
    gemm_tuning_cache: str = field(default="", metadata=_flag(
        "folder where --gemm-tuning keeps its results for later warm-ups (one file per GPU "
        "model and library versions; give it a writable volume where the root filesystem "
        "is read-only); empty = gemm-tuning/ under $SHARDSERVE_CACHE_DIR", metavar="DIR"))
    block_size: int = field(default=16, metadata=_flag("tokens per KV block", type=int))
    kv_cache_bytes: int = field(default=512 * MiB, metadata=_flag(
        "KV cache per rank on CPU: bytes, or with a unit (512MiB, 1GiB, 2G)",
        type=size_arg, metavar="SIZE"))
    gpu_memory_fraction: float = field(default=0.9, metadata=_flag(
        "share of GPU memory for weights, activations and KV cache", type=float))
    json_logs: bool = field(default=False, metadata=_flag(
        "log JSON lines (each with the rank)", name="--json-output", type=bool))
    rank: int = field(default=0, metadata=_flag("tensor-parallel rank of this shard",
                                                type=int))
    master_addr: str = field(default="127.0.0.1", metadata=_flag(
        "rank 0's IP (world size > 1)"))
    master_port: int = field(default=0, metadata=_flag(
        "rendezvous port on rank 0 (needed when world size > 1)", type=int))
    step_trace_dir: str = field(default="", metadata=_flag(
        "folder where the router and every shard append the timestamps of each step's "
        "hops, one file per process (benchmarks/steps/step_chain.py reads them); empty = off",
        metavar="DIR"))
    parent_pid: int = field(default=0, metadata=_flag(
        "stop once the process with this pid is no longer this shard's parent (it "
        "exited); 0 = never", type=int))

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path must be set")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.pdl not in ("auto", "off"):
            raise ValueError(f"pdl must be 'auto' or 'off', got {self.pdl!r}")
        if self.gemm_tuning not in ("auto", "off"):
            raise ValueError(f"gemm_tuning must be 'auto' or 'off', got {self.gemm_tuning!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("--speculative-method draft needs --speculative-model (the "
                             "draft model's folder)")
        if self.speculative_model and self.speculative_method != "draft":
            raise ValueError(f"--speculative-model is the draft model of "
                             f"--speculative-method draft (implied when the method is left "
                             f"out), not of {self.speculative_method}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min ({self.ngram_min}) and --ngram-max "
                             f"({self.ngram_max}) must satisfy 1 <= min <= max")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.parent_pid < 0:
            raise ValueError(f"parent_pid must be >= 0, got {self.parent_pid}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}"
            )

    @property
    def served_model_id(self) -> str:
        """The model id reported by ``Info``: ``model_id`` or else ``model_path``."""
        return self.model_id or self.model_path

    def for_rank(self, rank: int, master_addr: str, master_port: int) -> ShardConfig:
        """This configuration for rank ``rank`` of its group, whose ranks meet at
        ``master_addr:master_port`` (the launcher's template has rank 0 and no port).

        Raises:
            ValueError: ``rank`` is not in [0, world_size), or no port is given for a
                group of several ranks.
        """
        config = dataclasses.replace(self, rank=rank, master_addr=master_addr,
                                     master_port=master_port)
        config.check_rendezvous()
        return config

    def check_rendezvous(self) -> None:
        """Raise ValueError unless the ranks have a port to meet at (world_size > 1)."""
        if self.world_size > 1 and self.master_port == 0:
            raise ValueError("master_port must be set when world_size > 1")

    def torch_device(self) -> torch.device:
        """Resolve ``device`` ("auto" → cuda when available, else cpu; with several
        visible GPUs and world_size > 1, rank r takes ``cuda:r``). A CUDA device always
        comes back with its index (plain "cuda" → the current device, ``cuda:0`` in a
        fresh process), as ``torch.cuda.set_device`` and cuBLASLt's per-device handles
        need one."""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and self.world_size > 1 and torch.cuda.device_count() > 1:
            # Plain processes on one host see every GPU: one per rank. (Ray actors see
            # only their own GPU, so they stay on cuda:0.)
            return torch.device(f"cuda:{self.rank % torch.cuda.device_count()}")
        resolved = torch.device(device)
        if resolved.type == "cuda" and resolved.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return resolved

    def torch_dtype(self) -> torch.dtype:
        """Resolve ``dtype`` ("auto" → bfloat16 on CUDA, float32 on CPU)."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


# What --quantization fp8 and --kv-cache-dtype fp8 store, and how (the start-up log and
# /info: see quantization_details).
FP8_WEIGHTS_DETAILS = (
    "fp8 weights: the decoder layers' linear weights in float8_e4m3fn with a float32 scale "
    "per output channel, activations quantized to float8_e4m3fn per token (or with a "
    "checkpoint's static scale), products via torch._scaled_mm (up to 16 rows: our skinny "
    "kernel unless warm-up measured torch._scaled_mm faster); embeddings, LM head and "
    "norms stay in the model dtype")
FP8_KV_DETAILS = ("fp8 KV cache: keys and values in float8_e4m3fn with a float32 scale per "
                  "token and KV head")


def quantization_details(config: ShardConfig) -> str:
    """What ``config`` quantizes and how, in words ("" when nothing is)."""
    parts = [FP8_WEIGHTS_DETAILS] if config.quantization == "fp8" else []
    if config.kv_cache_dtype == "fp8":
        parts.append(FP8_KV_DETAILS)
    return "; ".join(parts)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling used by ``Info``)."""
    return str(dtype).removeprefix("torch.")

