"""Our kernels, one package: Triton kernels (CUDA; Triton's interpreter in tests), the
cuBLASLt products with a chosen algorithm, and the choice of which of them run.

- :mod:`.choices`: :class:`~shard.kernels.choices.KernelChoices`, which kernels one
  runner's model runs (decided when the runner is built; products tuned at warm-up).
- :mod:`.attention`: paged attention (decode, prefill), the cache write, and q/k norms +
  rotary + cache write fused.
- :mod:`.skinny_gemm`, :mod:`.gate_up_silu`, :mod:`.rms_norm`, :mod:`.silu_mul`: the
  decoder layer's products and elementwise ops.
- :mod:`.greedy`: greedy sampling in one pass; :mod:`.decode_inputs`: a decode graph's
  static inputs in one kernel.
- :mod:`.pdl`: programmatic dependent launch of the Triton kernels.
- :mod:`.cublaslt`, :mod:`.gemm_tuning`, :mod:`.tuning_cache`: cuBLASLt products, the
  warm-up's search for the fastest algorithm, and its results kept on disk.

NOTE: this package imports nothing itself, so that CPU-only installs (no Triton) import
:mod:`.choices` and the tuning modules without the Triton kernels; every module is
imported by name where it is used.
"""
