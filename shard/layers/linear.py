"""Tensor-parallel linear layers whose parameters load themselves.

Layout from Megatron-LM (Shoeybi et al. 2019, §3): in each block a column-parallel
layer (q/k/v, gate/up: output features split) feeds a row-parallel one (o_proj,
down_proj: input features split) whose partial sums are all-reduced, so one block costs
one all-reduce and the model code never sees a rank. Embedding and LM head split the
vocabulary; the LM head all-gathers the logits so every rank samples the same tokens.
Each layer takes this rank's :class:`~shard.distributed.ParallelContext` from
:func:`~shard.distributed.current_parallel` when it is constructed (the model is built
inside :func:`~shard.distributed.parallel_context`).

Every parameter carries ``weight_loader(param, loaded[, shard_id])``; ``loaded`` is a
``torch.Tensor`` or a lazy safetensors slice (``get_shape()`` + ``[a:b]`` indexing), so
each rank reads only its own rows/columns from the checkpoint (see :mod:`shard.weights`).
Every parameter also carries ``checkpoint_shapes``: the full (unsharded) checkpoint
shape per shard id, used to fill dummy weights sharded exactly like real ones.

Built inside :func:`~shard.quantization.config.quantization_context` with fp8 weights,
the q/k/v, o, gate/up and down layers hold their weight in float8 e4m3 with a
``weight_scale`` per output channel (:mod:`shard.layers.fp8`); the embedding and the LM
head stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed import ParallelContext, current_parallel
from shard.kernels.choices import KernelChoices, current_kernels
from shard.layers import fp8
from shard.layers.tp_layout import first_kv_head, kv_heads_per_rank, vocab_per_rank

WeightLoader = Callable[..., None]
# (shard id or None, full checkpoint shape)
CheckpointShapes = list[tuple[Any, tuple[int, ...]]]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach ``loader`` to ``param`` as ``param.weight_loader``."""
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's ``weight_loader``, or :func:`default_weight_loader`."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def set_checkpoint_shapes(param: nn.Parameter, shapes: CheckpointShapes) -> None:
    """Record the full checkpoint tensors ``param`` is loaded from (see module doc)."""
    param.checkpoint_shapes = shapes  # type: ignore[attr-defined]


def get_checkpoint_shapes(param: nn.Parameter) -> CheckpointShapes:
    """``param.checkpoint_shapes``, or ``[(None, param.shape)]`` for unsharded ones."""
    shapes: CheckpointShapes = getattr(param, "checkpoint_shapes", [(None, tuple(param.shape))])
    return shapes


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_range(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[start:start+size]`` along ``dim`` (0 or 1), read from disk only for that
    range when ``loaded`` is a lazy slice. Rows past the end are not read (the result
    may be shorter than ``size``)."""
    end = min(start + size, loaded_shape(loaded)[dim])
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, max(end - start, 0))
    index = (slice(start, end),) if dim == 0 else (slice(None), slice(start, end))
    out: torch.Tensor = loaded[index]
    return out


def read_all(loaded: Any) -> torch.Tensor:
    """The whole tensor (for unsharded parameters such as norms)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    out: torch.Tensor = loaded[:]
    return out


def _copy(target: torch.Tensor, piece: torch.Tensor, what: str) -> None:
    if target.shape != piece.shape:
        raise ValueError(
            f"shape mismatch for {what}: parameter {tuple(target.shape)} vs "
            f"checkpoint slice {tuple(piece.shape)}"
        )
    target.copy_(piece)


def default_weight_loader(param: nn.Parameter, loaded: Any) -> None:
    """Copy a full (unsharded) tensor into ``param``.

    Raises:
        ValueError: on a shape mismatch.
    """
    if tuple(param.shape) != loaded_shape(loaded):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {loaded_shape(loaded)}"
        )
    param.data.copy_(read_all(loaded))


def _check_divisible(value: int, tp: ParallelContext, what: str) -> None:
    if value % tp.size != 0:
        raise ValueError(f"{what}={value} is not divisible by tp_size={tp.size}")


def _matmul(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
    bias: torch.Tensor | None, kernels: KernelChoices,
) -> torch.Tensor:
    """``x @ weight.T + bias``: through the oneDNN-packed copy of ``weight`` when there is
    one (see :func:`pack_cpu_weights`); on CUDA at up to 16 rows (decode at small batch,
    short prefills) through our skinny GEMM kernel (:mod:`shard.kernels.skinny_gemm`),
    else through the cuBLASLt algorithm tuned at warm-up for the shape and row count, if
    any (:mod:`shard.kernels.gemm_tuning`), as ``kernels`` has them; else ``F.linear``."""
    if packed is not None:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out
    if x.is_cuda:
        kernel = kernels.skinny_linear
        skinny = kernel(x, weight, bias, pdl=kernels.pdl) if kernel is not None else None
        if skinny is not None:  # None: rows or dtypes the kernel does not take
            return skinny
        if kernels.gemms.tuned():
            tuned = kernels.gemms.run(x, weight, bias)
            if tuned is not None:
                return tuned
    return F.linear(x, weight, bias)


class _ParallelLinearBase(nn.Module):
    """Common fields: ``weight [out_local, in_local]``, optional ``bias [out_local]``, and
    ``packed_weight`` (set by :func:`pack_cpu_weights`), ``tp``, the parallel context the
    layer was built in, and ``kernels``, the kernel choices of the model it was built for
    (:func:`~shard.kernels.choices.current_kernels`). With fp8 weights (see the module
    doc) ``weight`` is float8_e4m3fn and ``weight_scale [out_local]`` float32 holds its
    scales, ``input_scale`` (scalar) a checkpoint's static activation scale or None."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: ParallelContext) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = current_kernels()
        self.packed_weight: torch.Tensor | None = None
        self.weight_scale, self.input_scale = fp8.scale_params(out_local, self.weight_loader)
        dtype = fp8.FP8_DTYPE if self.weight_scale is not None else None
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype),
                                   requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``: the fp8 product for fp8 weights, else :func:`_matmul`."""
        if self.weight_scale is not None:
            return fp8.fp8_linear(x, self.weight, self.weight_scale, bias, self.input_scale)
        return _matmul(x, self.weight, self.packed_weight, bias, self.kernels)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        """Where the output rows of checkpoint tensor ``shard_id`` go: (first row here,
        rows, first row in the checkpoint tensor)."""
        raise NotImplementedError

    def _store_rows(self, param: nn.Parameter, shard_id: Any, piece: torch.Tensor,
                    what: str) -> None:
        """Copy ``piece`` (this rank's rows of checkpoint tensor ``shard_id``) into
        ``param``; an fp8 layer's weight quantized per row unless already fp8, its
        scales loaded (:func:`shard.layers.fp8.store_rows`)."""
        offset, size, _ = self._rows(shard_id)
        if self.weight_scale is not None and param is not self.bias:
            fp8.store_rows(self, param, offset, size, piece, what)
            return
        _copy(param.data.narrow(0, offset, size), piece, what)

    def _record_shapes(self, shapes: Sequence[tuple[Any, int]], input_size: int) -> None:
        """Checkpoint shapes from ``(shard_id, full output size)`` pairs."""
        set_checkpoint_shapes(self.weight, [(s, (out, input_size)) for s, out in shapes])
        if self.bias is not None:
            set_checkpoint_shapes(self.bias, [(s, (out,)) for s, out in shapes])

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinearBase):
    """``y = x W^T + b`` with W's rows (output features) split across ranks; no
    communication.

    Args:
        input_size: input features (full).
        output_size: output features (full); this rank holds output_size / tp_size.

    Forward: ``[num_tokens, input_size] → [num_tokens, output_size / tp_size]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_parallel()
        _check_divisible(output_size, tp, "output_size")
        super().__init__(input_size, output_size // tp.size, bias, tp)
        self._record_shapes([(None, output_size)], input_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        rows = self.weight.shape[0]
        return 0, rows, self.tp.rank * rows

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        shard_id = args[0] if args else None
        if fp8.is_scale(self, param):
            fp8.load_scale(self, param, loaded, shard_id)
            return
        _, size, start = self._rows(shard_id)
        self._store_rows(param, shard_id, read_range(loaded, 0, start, size),
                         f"shard {shard_id}" if args else "column slice")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (e.g. gate_proj + up_proj). Checkpoint tensors load by ``shard_id`` (index into
    ``output_sizes``); each is split across ranks independently, so a rank holds
    ``[gate_local | up_local]``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False):
        for size in output_sizes:
            _check_divisible(size, current_parallel(), "output_size")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        self._record_shapes(list(enumerate(output_sizes)), input_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        sizes = [s // self.tp.size for s in self.output_sizes]
        index = int(shard_id)
        return sum(sizes[:index]), sizes[index], self.tp.rank * sizes[index]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads split across ranks, KV heads split or, when
    fewer than ranks, replicated (see :mod:`shard.layers.tp_layout`).

    Output layout per rank: ``[q (num_heads_local * head_dim) | k | v]`` with
    ``num_kv_heads_local * head_dim`` each for k and v. Checkpoint tensors load with
    ``shard_id`` in ``{"q", "k", "v"}``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ):
        tp = current_parallel()
        _check_divisible(num_heads, tp, "num_heads")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} cannot be split over {tp.size} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        self.first_kv_head = first_kv_head(num_kv_heads, tp.rank, tp.size)
        # The local width is what this rank holds (KV heads may be replicated).
        total_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, total_local * tp.size, bias)
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        self._record_shapes([("q", q_full), ("k", kv_full), ("v", kv_full)], hidden_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q_size, self.tp.rank * q_size
        offset = q_size if shard_id == "k" else q_size + kv_size
        return offset, kv_size, self.first_kv_head * self.head_dim


class RowParallelLinear(_ParallelLinearBase):
    """``y = x W^T + b`` with W's columns (input features) split across ranks; partial
    outputs are summed with an all-reduce. The bias is added once, after the reduce.

    Forward: ``[num_tokens, input_size / tp_size] → [num_tokens, output_size]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = current_parallel()
        _check_divisible(input_size, tp, "input_size")
        super().__init__(input_size // tp.size, output_size, bias, tp)
        self._record_shapes([(None, output_size)], input_size)

    def _rows(self, shard_id: Any) -> tuple[int, int, int]:
        return 0, self.weight.shape[0], 0  # every output row, scales included

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        if fp8.is_scale(self, param):
            fp8.load_scale(self, param, loaded, None)
            return
        if param.dim() == 1:
            default_weight_loader(param, loaded)
            return
        cols = param.shape[1]
        self._store_rows(param, None, read_range(loaded, 1, self.tp.rank * cols, cols),
                         "row slice")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._product(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split across ranks: rank r holds rows
    ``[r * n, (r+1) * n)`` with ``n = ceil(vocab_size / tp_size)`` (rows past the
    vocabulary are zeros). Each rank embeds the ids it holds, zeros elsewhere, and
    the all-reduce assembles the full embedding.

    Forward: ``input_ids [num_tokens] int64 → [num_tokens, hidden_size]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = current_parallel()
        self.kernels = current_kernels()  # the LM head's product (ParallelLMHead)
        self.vocab_size = vocab_size
        self.num_local = vocab_per_rank(vocab_size, self.tp.size)
        self.packed_weight: torch.Tensor | None = None  # used by ParallelLMHead only
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        set_checkpoint_shapes(self.weight, [(None, (vocab_size, hidden_size))])

    def weight_loader(self, param: nn.Parameter, loaded: Any, *args: Any) -> None:
        piece = read_range(loaded, 0, self.tp.rank * self.num_local, self.num_local)
        _copy(param.data[: piece.shape[0]], piece, "vocab slice")
        param.data[piece.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.tp.rank * self.num_local
        mask = (local >= 0) & (local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)
        out = out * mask[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, rows split across ranks; the logits are
    all-gathered so every rank holds (and samples from) the full row.

    Forward: ``hidden [n, hidden_size] → logits [n, vocab_size]`` in ``dtype``
    (float32 by default; None: the weights' dtype, the product's own output, which a
    float32 cast after it would hold exactly).
    """

    def forward(self, hidden: torch.Tensor,
                dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        logits = _matmul(hidden, self.weight, self.packed_weight, None, self.kernels)
        if dtype is not None:
            logits = logits.to(dtype)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]


class _ModuleTree(Protocol):
    def modules(self) -> Iterator[nn.Module]: ...


def pack_cpu_weights(model: _ModuleTree) -> int:
    """Reorder the float32 CPU weights of every linear layer and of the LM head into
    oneDNN's blocked layout, once, so each forward skips re-packing them.

    On CPU the plain ``F.linear`` (MKL sgemm) re-packs the weight on every call; with
    the few rows of a decode step that costs as much as the arithmetic. Measured on a
    2-core AVX-512 EPYC, one thread, SmolLM2-135M shapes, all weights of one step read
    from memory: 8 rows 84-104 ms per step with ``F.linear`` against 44 ms packed, 64
    rows 259 against 176 ms, and prefill rows about 15% faster (see
    benchmarks/results/serving-cpu.md). Results differ from ``F.linear`` by float32
    rounding only (another summation order).

    The dense weight of a packed layer is released (replaced by an empty tensor) unless
    another module shares it (a tied LM head keeps the embedding's). Layers on other
    devices or in other dtypes are left alone, as is everything when oneDNN is absent.

    Source: oneDNN inner-product primitive with a blocked weight format, reached through
    the ``mkldnn::_reorder_linear_weight`` / ``mkldnn::_linear_pointwise`` operators that
    PyTorch's Inductor uses for the same purpose.

    Returns:
        Number of weight matrices packed.
    """
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return 0
    modules = [
        m for m in model.modules() if isinstance(m, (_ParallelLinearBase, ParallelLMHead))
    ]
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    packed: dict[int, torch.Tensor] = {}  # one packed copy per parameter
    for m in modules:
        weight = m.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        if id(weight) not in packed:
            packed[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        m.packed_weight = packed[id(weight)]
    for m in modules:
        if m.packed_weight is not None and owners.get(id(m.weight), 0) == 1:
            m.weight.data = m.weight.data.new_empty(0)
    return len(packed)


def linear_weights(model: _ModuleTree) -> list[torch.Tensor]:
    """The weights of every tensor-parallel linear layer of ``model`` whose product runs
    without a bias (the decoder layers' projections, a row-parallel layer's bias being
    added after the all-reduce; not the embedding or the LM head), in module order.
    fp8 weights are left out: their products run through ``torch._scaled_mm``, which the
    warm-up's cuBLASLt tuning does not time (yet)."""
    return [m.weight.detach() for m in model.modules() if isinstance(m, _ParallelLinearBase)
            and (m.bias is None or isinstance(m, RowParallelLinear))
            and m.weight_scale is None]


def lm_head_weights(model: _ModuleTree) -> list[torch.Tensor]:
    """The weights of ``model``'s LM heads (:class:`ParallelLMHead`; one in a causal LM)."""
    return [m.weight.detach() for m in model.modules() if isinstance(m, ParallelLMHead)]
