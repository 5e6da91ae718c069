"""Quantized weights and KV caches: FP8 (e4m3) on GPUs with fp8 tensor cores, and on
CPU for tests.

- :mod:`.fp8`: quantize / dequantize by rows, the fp8 linear product.
- :mod:`.config`: what ``--quantization`` / ``--kv-cache-dtype`` and the checkpoint ask
  for, checked against the device; handed to the layers being built.
"""
