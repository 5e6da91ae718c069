"""The warm-up's GEMM tuning results kept on disk, one JSON file per GPU model and
library versions (:class:`TuningCache`), so that a restart takes them instead of
searching again, and where that file lies (:func:`cache_for`: ``--gemm-tuning-cache``,
else under :func:`~shard.config.default_cache_dir`). The search itself is
:mod:`shard.kernels.gemm_tuning`'s.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shard.config import ShardConfig, default_cache_dir
from shard.kernels import cublaslt

CACHE_FORMAT = 2  # bump when the file's layout, a record's meaning or the search changes


def cache_identity(device: torch.device) -> dict[str, Any]:
    """What a tuning result depends on besides the shape: the GPU model (name, SMs,
    compute capability), cuBLASLt's version (the meaning of an algorithm's bytes), CUDA
    and PyTorch's versions (cuBLAS's own pick, the baseline)."""
    props = torch.cuda.get_device_properties(device)
    return {"format": CACHE_FORMAT, "device": props.name, "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "cublaslt": cublaslt.version(),
            "cuda": torch.version.cuda, "torch": torch.__version__}


def cache_file(directory: Path, identity: dict[str, Any]) -> Path:
    """The file in ``directory`` for results measured under ``identity``: the device
    name and a digest of the whole identity."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9]+", "-", str(identity.get("device", "gpu"))).strip("-")
    return directory / f"{name}-{digest}.json"


def _key(rows: int, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{rows},{n},{k},{str(dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class TunedProduct:
    """What :func:`shard.kernels.gemm_tuning.tune` measured for one weight shape at one
    row count.

    Attributes:
        rows, n, k: the product ``[rows, k] @ [n, k].T``.
        default_us: ``F.linear``'s µs per product.
        best_us: the fastest cuBLASLt variant's µs per product.
        algorithm: that variant, or None where none beat ``F.linear`` by
            :data:`shard.kernels.gemm_tuning.MARGIN` (then ``F.linear`` stays).
        screened: how many variants were timed (0 for a result from the cache).
        cached: whether it was taken from a :class:`TuningCache`.
    """

    rows: int
    n: int
    k: int
    default_us: float
    best_us: float
    algorithm: cublaslt.Algorithm | None
    screened: int
    cached: bool = False

    def describe(self) -> str:
        pick = self.algorithm.describe() if self.algorithm else "F.linear kept"
        return (f"[{self.rows}, {self.k}] x [{self.n}, {self.k}]: F.linear "
                f"{self.default_us:.0f} µs, best of {self.screened} variants "
                f"{self.best_us:.0f} µs: {pick}")


class TuningCache:
    """Results of earlier warm-ups on this GPU model and library versions, one JSON file
    (:func:`cache_file`), so that a restart reuses them instead of searching again (as
    PyTorch's TunableOp keeps its results in a CSV file).

    A file that is missing, unreadable or written under another identity counts as empty;
    one that cannot be written is left alone: either way the server tunes as without a
    cache (a warning is logged). Processes of one host (tensor-parallel ranks) merge
    their results into the file on :meth:`save`; its replacement is atomic.
    """

    def __init__(self, path: Path, identity: dict[str, Any], log: Any = None) -> None:
        self.path, self.identity, self.log = path, identity, log
        self.records: dict[str, dict[str, Any]] = self._read()
        self.added: set[str] = set()  # keys recorded since the last save

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self._warn("unreadable, ignored", e)
            return {}
        if not isinstance(data, dict) or data.get("identity") != self.identity:
            return {}
        records = data.get("records")
        return dict(records) if isinstance(records, dict) else {}

    def _warn(self, what: str, error: Exception) -> None:
        if self.log is not None:
            self.log.warning("GEMM tuning cache {}: {} ({})", self.path, what, error)

    def get(self, rows: int, n: int, k: int, dtype: torch.dtype) -> TunedProduct | None:
        """The result recorded for this product, or None (not recorded, or malformed)."""
        record = self.records.get(_key(rows, n, k, dtype))
        if not isinstance(record, dict):
            return None
        try:
            algo = record["algorithm"]
            algorithm = None
            if algo is not None:
                raw = bytes.fromhex(algo["raw"])
                if len(raw) != cublaslt.ALGO_BYTES:
                    return None
                algorithm = cublaslt.Algorithm(**{**algo, "raw": raw})
            best = record["best_us"]
            return TunedProduct(rows, n, k, float(record["default_us"]),
                                float("inf") if best is None else float(best), algorithm, 0,
                                cached=True)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    def put(self, result: TunedProduct, dtype: torch.dtype, search: str) -> None:
        """Record ``result`` (``search``: how it was found, "full" or "choice" among
        other row counts' winners; kept for whoever reads the file)."""
        algo = result.algorithm
        key = _key(result.rows, result.n, result.k, dtype)
        self.records[key] = {
            "default_us": result.default_us,
            "best_us": result.best_us if result.best_us != float("inf") else None,
            "algorithm": None if algo is None else {
                **dataclasses.asdict(algo), "raw": algo.raw.hex()},
            "search": search,
        }
        self.added.add(key)

    def save(self) -> None:
        """Write the records added since the last save over what the file holds now (other
        processes' results kept), under an exclusive lock of a file beside it."""
        if not self.added:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**self.records, **self._read(),
                          **{key: self.records[key] for key in self.added}}
                body = json.dumps({"identity": self.identity, "records": merged}, indent=1)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-")
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)
                tmp = None
        except OSError as e:
            self._warn("not written", e)
            return
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        self.records, self.added = merged, set()


def cache_for(config: ShardConfig, device: torch.device, log: Any = None) -> TuningCache | None:
    """The file of earlier warm-ups' tuning results for ``device``'s GPU and these
    libraries, in ``--gemm-tuning-cache`` (``~`` expanded) or under
    :func:`~shard.config.default_cache_dir` (None where cuBLASLt cannot be loaded: then
    nothing is tuned; or no cache folder resolves: then nothing is kept, with a warning
    on ``log``)."""
    try:
        identity = cache_identity(device)
    except (OSError, AttributeError):
        return None
    try:
        folder = (Path(config.gemm_tuning_cache).expanduser() if config.gemm_tuning_cache
                  else default_cache_dir() / "gemm-tuning")
        path = cache_file(folder, identity)
    except RuntimeError as e:  # no cache folder configured and no home folder
        if log is not None:
            log.warning("GEMM tuning results not kept: {}", e)
        return None
    return TuningCache(path, identity, log)
