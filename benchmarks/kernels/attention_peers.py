"""Peers for benchmarks/kernels/attention.py: FlashInfer, flash-attn and flex_attention with a
paged block mask, each built outside the timed region (plans, compiled graphs) and
returned as a zero-argument callable, or None with a note when it cannot be brought up."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.kernels.paged_cases import PagedCase, reference, rel_error
from shard.attention.flashinfer_backend import WORKSPACE_BYTES, paged_kv_indices

FLEX_BUDGET_S = 150.0  # compile time allowed for flex (one compile per shape)


def _version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as exc:
        return f"not brought up ({type(exc).__name__}: {exc})"


def flashinfer_version() -> str:
    return _version("flashinfer")


def flash_attn_version() -> str:
    return _version("flash_attn")


class Peers:
    """Builds peer callables; ``notes`` collects why a peer was left out."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._fi: Any = self._import("flashinfer")
        self._fa: Any = self._import("flash_attn")
        self._ws = (torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
                    if self._fi is not None else None)
        self._flex: Any = None
        self._flex_s = 0.0
        self._checked: set[str] = set()

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            print("NOTE", text, flush=True)

    def _import(self, name: str) -> Any:
        try:
            return importlib.import_module(name)
        except Exception as exc:
            self.note(f"{name} not brought up: {type(exc).__name__}: {exc}")
            return None

    def _check_once(self, key: str, fn: Callable[[], Any], case: PagedCase) -> bool:
        """Compare a peer's output with the fp32 reference on its first use."""
        if key in self._checked:
            return True
        out = fn().reshape(case.q.shape)
        err = rel_error(out, reference(case)[0])
        self.note(f"{key}: rel err vs fp32 reference {err:.2e}")
        self._checked.add(key)
        return err < 1e-2

    def flashinfer_decode(self, case: PagedCase, tensor_cores: bool) -> Callable[[], Any] | None:
        if self._fi is None:
            return None
        md, kc = case.metadata, case.cache
        try:
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._ws, "NHD", use_tensor_cores=tensor_cores, backend="fa2")
            indptr, indices, last = paged_kv_indices(md.block_tables, md.seq_lens, kc.block_size)
            w.plan(indptr, indices, last, case.q.shape[1], kc.key.shape[2], case.q.shape[2],
                   kc.block_size, sm_scale=case.scale, q_data_type=case.q.dtype,
                   kv_data_type=kc.key.dtype)
            out = torch.empty_like(case.q)

            def fn() -> Any:
                return w.run(case.q, (kc.key, kc.value), out=out)

            key = f"FlashInfer decode tc={tensor_cores}"
            if not self._check_once(key, fn, case):
                self.note(f"{key} disagrees with the reference: left out")
                return None
            return fn
        except Exception as exc:
            self.note(f"FlashInfer decode (tc={tensor_cores}) failed: {type(exc).__name__}: {exc}")
            return None

    def flashinfer_prefill(self, case: PagedCase) -> Callable[[], Any] | None:
        if self._fi is None:
            return None
        md, kc = case.metadata, case.cache
        try:
            w = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._ws, "NHD", backend="fa2")
            indptr, indices, last = paged_kv_indices(md.block_tables, md.seq_lens, kc.block_size)
            w.plan(md.cu_seqlens_q, indptr, indices, last, case.q.shape[1], kc.key.shape[2],
                   case.q.shape[2], kc.block_size, causal=True, sm_scale=case.scale,
                   q_data_type=case.q.dtype, kv_data_type=kc.key.dtype)

            def fn() -> Any:
                return w.run(case.q, (kc.key, kc.value))

            self._check_once(f"FlashInfer prefill n={md.num_tokens}", fn, case)
            return fn
        except Exception as exc:
            self.note(f"FlashInfer prefill failed: {type(exc).__name__}: {exc}")
            return None

    def flash_attn_decode(self, batch: int, ctx: int) -> Callable[[], Any] | None:
        if self._fa is None:
            return None
        h, hkv, d, bs = 64, 8, 128, 256
        pages = batch * ctx // bs + 1
        kc = torch.randn(pages, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(pages, device="cuda")[: batch * (ctx // bs)].view(batch, -1)
        bt = bt.to(torch.int32)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
        return lambda: self._fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq,
                                                        block_table=bt, causal=True)

    def flash_attn_prefill(self, n: int) -> Callable[[], Any] | None:
        if self._fa is None:
            return None
        q = torch.randn(n, 64, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        return lambda: self._fa.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)

    def flex_decode(self, case: PagedCase) -> Callable[[], Any] | None:
        """flex_attention over the physical cache [1, kv_heads, slots, head_dim] with a
        block mask whose KV blocks are the pages of each sequence (kv_indices = the
        block table), so each query reads only its own pages."""
        if self._flex_s > FLEX_BUDGET_S:
            self.note("flex paged: compile budget spent, later points left out")
            return None
        try:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention

            if self._flex is None:
                self._flex = torch.compile(flex_attention, dynamic=False)
            md, kc = case.metadata, case.cache
            b, h, d = case.q.shape
            nb, bs, hkv, _ = kc.key.shape
            k = kc.key.view(1, nb * bs, hkv, d).transpose(1, 2)
            v = kc.value.view(1, nb * bs, hkv, d).transpose(1, 2)
            counts = ((md.seq_lens + bs - 1) // bs).to(torch.int32).view(b, 1, 1)
            # NOTE: kv_indices must span every physical block (its width sizes the mask);
            # pad each row with its own first block so padding never adds another's page
            bt = md.block_tables.to(torch.int32)
            idx = bt[:, :1].expand(b, nb).clone()
            idx[:, : bt.shape[1]] = bt
            idx = idx.view(b, 1, 1, nb)
            # owner[slot] = sequence whose context holds that slot (-1: none); the kernel
            # skips mask_mod on full blocks, eager flex (and partial blocks) use it
            owner = torch.full((nb * bs,), -1, dtype=torch.int64, device=kc.key.device)
            for i, (row, n) in enumerate(zip(bt.tolist(), md.seq_lens.tolist(), strict=False)):
                slots = torch.tensor([row[p // bs] * bs + p % bs for p in range(n)])
                owner[slots.to(owner.device)] = i

            def mask_mod(bi: Any, hi: Any, qi: Any, kvi: Any) -> Any:
                return owner[kvi] == bi

            mask = BlockMask.from_kv_blocks(
                torch.zeros_like(counts), idx, counts, idx, BLOCK_SIZE=(128, bs),
                mask_mod=mask_mod, seq_lengths=(1, nb * bs))
            q = case.q.view(b, h, 1, d)

            def fn() -> Any:
                return self._flex(q, k, v, block_mask=mask, scale=case.scale, enable_gqa=True)

            t0 = time.time()
            ok = self._check_once(f"flex paged decode b={b}", fn, case)
            self._flex_s += time.time() - t0
            return fn if ok else None
        except Exception as exc:
            self.note(f"flex paged decode failed: {type(exc).__name__}: {str(exc)[:300]}")
            self._flex_s = FLEX_BUDGET_S + 1  # do not retry
            return None
