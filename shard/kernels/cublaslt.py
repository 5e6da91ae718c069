"""cuBLASLt matrix products with a chosen algorithm, through ``ctypes``.

``torch.nn.functional.linear`` lets cuBLAS pick one kernel per shape by its heuristic.
cuBLASLt's ``cublasLtMatmulAlgoGetHeuristic`` also lists the other candidates it would
accept (other tiles, cluster shapes, split-K counts): :func:`candidates` returns them and
:class:`LtLinear` runs ``y = x @ w.T`` with one of them, on PyTorch's current stream (so
it can be captured in a CUDA graph). The library is the one PyTorch itself loaded.

Layout: PyTorch's row-major ``y [m, n] = x [m, k] @ w [n, k].T`` is cuBLAS's
column-major ``D [n, m] = op(A) B`` with ``A = w`` read transposed (``CUBLAS_OP_T``, a
``k × n`` column-major matrix, leading dimension ``k``) and ``B = x`` untransposed
(``k × m``, leading dimension ``k``), ``D`` ``n × m`` with leading dimension ``n``.

Source: cuBLAS documentation, "Using the cuBLASLt API" (``cublasLtMatmul``,
``cublasLtMatmulAlgoGetHeuristic``, ``cublasLtMatmulAlgoConfigGetAttribute``).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
MATMUL_DESC_TRANSA = 3
MATMUL_DESC_TRANSB = 4
PREF_MAX_WORKSPACE_BYTES = 1
OP_N, OP_T = 0, 1
# cublasLtMatmulAlgoConfigAttributes_t
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM = 0, 1, 2
CONFIG_REDUCTION_SCHEME, CONFIG_CTA_SWIZZLING, CONFIG_CUSTOM_OPTION = 3, 4, 5
CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID = 6, 8
# cublasLtMatmulAlgoCapAttributes_t: arrays of uint32 ids
CAP_TILE_IDS, CAP_STAGES_IDS = 6, 13
# cublasLtClusterShape_t: 1x1x1, 2x1x1, 4x1x1, 1x2x1, 2x2x1, 4x2x1, 1x4x1
CLUSTER_SHAPES = (2, 3, 4, 5, 6, 7, 8)

WORKSPACE_BYTES = 32 << 20
_DTYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t


ALGO_BYTES = ctypes.sizeof(_Algo)  # the length of an Algorithm's ``raw``


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than ``CUBLAS_STATUS_SUCCESS``."""


def _loaded_library_path() -> str:
    """The path of the ``libcublasLt`` this process has mapped (PyTorch's), after one
    CUDA product has initialised cuBLAS."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in path:
                return path
    return "libcublasLt.so"


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_loaded_library_path())
    vp, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                           ctypes.POINTER(_Heuristic),
                                           ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp,
                                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp,
                                                 ctypes.c_size_t],
        "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp,
                                              ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo),
                                    ctypes.POINTER(_Heuristic)],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                           ctypes.POINTER(_Algo), vp, ctypes.c_size_t, vp],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.cublasLtGetVersion.argtypes = []
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return lib


def library() -> ctypes.CDLL:
    """The ``libcublasLt`` PyTorch loaded, with the signatures used here.

    Raises:
        OSError: if it cannot be loaded.
        AttributeError: if it lacks one of the calls used here.
    """
    return _lib()


def version() -> int:
    """cuBLASLt's version number (``cublasLtGetVersion``: major * 10000 + minor * 100 +
    patch), which decides the meaning of an algorithm's configuration."""
    return int(_lib().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cuBLAS status {status}")


def _handle(device: int | None) -> ctypes.c_void_p:
    """The cuBLASLt handle of CUDA device ``device`` (None: the current device)."""
    return _device_handle(torch.cuda.current_device() if device is None else device)


@functools.cache
def _device_handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@dataclass(frozen=True)
class Algorithm:
    """One candidate of cuBLASLt's heuristic for a shape.

    Attributes:
        index: its rank in the heuristic's list (0: what cuBLASLt would pick).
        algo_id, tile_id, splitk, stages_id, cluster_id: its configuration
            (``cublasLtMatmulAlgoConfigAttributes_t``; ids of cuBLASLt's enums).
        workspace: bytes of workspace it needs.
        waves: the heuristic's estimate of waves of thread blocks over the SMs.
    """

    index: int
    algo_id: int
    tile_id: int
    splitk: int
    stages_id: int
    cluster_id: int
    workspace: int
    waves: float
    raw: bytes

    def describe(self) -> str:
        return (f"#{self.index} id {self.algo_id} tile {self.tile_id} stages {self.stages_id} "
                f"split-K {self.splitk} cluster {self.cluster_id} waves {self.waves:.2f}")


class _Plan:
    """Descriptors of ``y [m, n] = x [m, k] @ w [n, k].T`` in ``dtype`` (see module doc)."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype) -> None:
        lib, vp = _lib(), ctypes.c_void_p
        cuda_type = _DTYPES[dtype]
        self.desc, self.a, self.b, self.d, self.pref = vp(), vp(), vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F,
                                            CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, op in ((MATMUL_DESC_TRANSA, OP_T), (MATMUL_DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4),
                   "cublasLtMatmulDescSetAttribute")
        for layout, rows, cols, ld in ((self.a, k, n, k), (self.b, k, m, k), (self.d, n, m, n)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), cuda_type, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)),
               "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(
            self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
            "cublasLtMatmulPreferenceSetAttribute")

    def __del__(self) -> None:
        try:
            lib = _lib()
            lib.cublasLtMatmulPreferenceDestroy(self.pref)
            for layout in (self.a, self.b, self.d):
                lib.cublasLtMatrixLayoutDestroy(layout)
            lib.cublasLtMatmulDescDestroy(self.desc)
        except TypeError:  # at interpreter exit the module's globals are gone
            pass


def _config(algo: _Algo, attr: int, size: int) -> int:
    value = ctypes.c_uint64(0)
    written = ctypes.c_size_t(0)
    status = _lib().cublasLtMatmulAlgoConfigGetAttribute(
        ctypes.byref(algo), attr, ctypes.byref(value), size, ctypes.byref(written))
    return int(value.value) if status == 0 else -1


@functools.lru_cache(maxsize=512)
def _plan(m: int, n: int, k: int, dtype: torch.dtype) -> _Plan:
    return _Plan(m, n, k, dtype)


def candidates(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
               limit: int = 64, device: int | None = None) -> list[Algorithm]:
    """The algorithms cuBLASLt's heuristic offers for ``[m, k] @ [n, k].T`` in ``dtype``
    (float32 accumulation), best first by its own ranking, at most ``limit``.

    Raises:
        CublasLtError: if the heuristic call fails.
        KeyError: for a dtype other than bfloat16 or float16.
    """
    plan = _plan(m, n, k, dtype)
    results = (_Heuristic * limit)()
    count = ctypes.c_int(0)
    _check(_lib().cublasLtMatmulAlgoGetHeuristic(
        _handle(device), plan.desc, plan.a, plan.b, plan.d, plan.d, plan.pref, limit,
        results, ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
    return [_algorithm(i, results[i]) for i in range(count.value) if results[i].state == 0]


def _algorithm(index: int, r: _Heuristic) -> Algorithm:
    a = r.algo
    return Algorithm(
        index=index, algo_id=_config(a, CONFIG_ID, 4), tile_id=_config(a, CONFIG_TILE_ID, 4),
        splitk=_config(a, CONFIG_SPLITK_NUM, 4), stages_id=_config(a, CONFIG_STAGES_ID, 4),
        cluster_id=_config(a, CONFIG_CLUSTER_SHAPE_ID, 2), workspace=int(r.workspace_size),
        waves=float(r.waves_count), raw=bytes(a))


def _check_algo(m: int, n: int, k: int, dtype: torch.dtype, algo: _Algo,
                device: int | None) -> _Heuristic | None:
    """``cublasLtMatmulAlgoCheck``'s result for ``algo`` at this shape, or None where it
    is rejected or needs more than :data:`WORKSPACE_BYTES`."""
    plan, result = _plan(m, n, k, dtype), _Heuristic()
    if _lib().cublasLtMatmulAlgoCheck(_handle(device), plan.desc, plan.a, plan.b, plan.d, plan.d,
                                      ctypes.byref(algo), ctypes.byref(result)) != 0:
        return None
    if result.state != 0 or result.workspace_size > WORKSPACE_BYTES:
        return None
    return result


def accepts(m: int, n: int, k: int, dtype: torch.dtype, algorithm: Algorithm,
            device: int | None = None) -> bool:
    """Whether cuBLASLt accepts ``algorithm`` (found for another row count, say) for
    ``[m, k] @ [n, k].T`` in ``dtype`` within the workspace."""
    return _check_algo(m, n, k, dtype, _Algo.from_buffer_copy(algorithm.raw), device) is not None


def _cap_ids(algo: _Algo, attr: int) -> list[int]:
    """A capability of ``algo`` that is an array of uint32 ids (empty if it has none)."""
    lib, size = _lib(), ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0,
                                             ctypes.byref(size)) != 0 or size.value == 0:
        return []
    ids = (ctypes.c_uint32 * (size.value // 4))()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ids, size.value,
                                             ctypes.byref(size)) != 0:
        return []
    return list(ids)


class _Variants:
    """Distinct algorithms for one shape that ``cublasLtMatmulAlgoCheck`` accepts."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, device: int | None) -> None:
        self.shape, self.device = (m, n, k, dtype), device
        self.seen: set[tuple[int, ...]] = set()
        self.found: list[Algorithm] = []

    def add(self, algo: _Algo, tile: int | None = None, cluster: int | None = None) -> None:
        lib = _lib()
        for attr, value, size in ((CONFIG_TILE_ID, tile, 4), (CONFIG_CLUSTER_SHAPE_ID, cluster, 2)):
            if value is None:
                continue
            v = ctypes.c_uint32(value) if size == 4 else ctypes.c_uint16(value)
            if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr,
                                                        ctypes.byref(v), size) != 0:
                return
        m, n, k, dtype = self.shape
        result = _check_algo(m, n, k, dtype, algo, self.device)
        if result is None:
            return
        result.algo = algo
        a = _algorithm(len(self.found), result)
        key = (a.algo_id, a.tile_id, a.splitk, a.stages_id, a.cluster_id,
               _config(algo, CONFIG_REDUCTION_SCHEME, 4), _config(algo, CONFIG_CTA_SWIZZLING, 4),
               _config(algo, CONFIG_CUSTOM_OPTION, 4))
        if key not in self.seen:
            self.seen.add(key)
            self.found.append(a)


def variants(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
             limit: int = 64, device: int | None = None,
             clusters: tuple[int, ...] = CLUSTER_SHAPES) -> list[Algorithm]:
    """The heuristic's candidates (:func:`candidates`) and, around each, every tile its
    algorithm supports (``CUBLASLT_ALGO_CAP_TILE_IDS``) with each of ``clusters``
    (:data:`CLUSTER_SHAPES` by default; empty: the candidate's own cluster shape), its
    split-K, stages and other settings kept, that ``cublasLtMatmulAlgoCheck`` accepts for
    this shape within the workspace, without duplicates. ``index`` numbers them in that
    order.

    Raises:
        CublasLtError: if the heuristic call fails.
    """
    found = _Variants(m, n, k, dtype, device)
    for base in candidates(m, n, k, dtype, limit, device):
        found.add(_Algo.from_buffer_copy(base.raw))
        for tile in _cap_ids(_Algo.from_buffer_copy(base.raw), CAP_TILE_IDS):
            for cluster in clusters or (None,):
                found.add(_Algo.from_buffer_copy(base.raw), tile, cluster)
    return found.found


def cluster_variants(m: int, n: int, k: int, dtype: torch.dtype, algorithm: Algorithm,
                     device: int | None = None) -> list[Algorithm]:
    """``algorithm`` with each of :data:`CLUSTER_SHAPES` that cuBLASLt accepts for this
    shape (its own first)."""
    found = _Variants(m, n, k, dtype, device)
    found.add(_Algo.from_buffer_copy(algorithm.raw))
    for cluster in CLUSTER_SHAPES:
        found.add(_Algo.from_buffer_copy(algorithm.raw), cluster=cluster)
    return found.found


@functools.cache
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


def matmul(x: torch.Tensor, w: torch.Tensor, algorithm: Algorithm,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` (``x [m, k]``, ``w [n, k]``, both contiguous, same dtype and CUDA
    device) with ``algorithm`` (from :func:`candidates` for this ``m, n, k``), on the
    current stream; returns ``out`` or a new ``[m, n]`` tensor.

    Raises:
        CublasLtError: if cuBLASLt rejects the call.
    """
    m, k = x.shape
    n = w.shape[0]
    device = x.device.index or 0
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    plan = _plan(m, n, k, x.dtype)
    algo = _Algo.from_buffer_copy(algorithm.raw)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
    _check(_lib().cublasLtMatmul(
        _handle(device), plan.desc, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), plan.a,
        ctypes.c_void_p(x.data_ptr()), plan.b, ctypes.byref(zero), ctypes.c_void_p(out.data_ptr()),
        plan.d, ctypes.c_void_p(out.data_ptr()), plan.d, ctypes.byref(algo),
        ctypes.c_void_p(_workspace(device).data_ptr()), WORKSPACE_BYTES, stream), "cublasLtMatmul")
    return out
