#!/bin/bash
# The GPU measurements still owed by open work, one part per device call (each under the
# 600 s a call may run), run on the lent GPU machine from the checkout with .device carried
# (fill it first with benchmarks/serving/gpu_prepare.sh):
#   bash benchmarks/gpu_pending.sh serving      # at most 540 s (60 of tests, 480 of serving): our server with
#       default flags, then nano-vllm, then ours with fp8 weights + fp8 KV; the first part on a
#       fresh machine, so that the Triton cache is as cold as a user's
#   bash benchmarks/gpu_pending.sh speculative  # the verify/decode/draft step costs
#   bash benchmarks/gpu_pending.sh tests        # the GPU-only tests of the fp8 and speculative code
# Everything lands in $OUT (the device tool's output folder; default /tmp/gpu-out).
set -uo pipefail
part=${1:?usage: gpu_pending.sh serving|speculative|tests}
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
site="python3 -m pip install -q --no-index --no-deps --no-compile --target"
[ -d /tmp/site ] || $site /tmp/site .device/whl/*.whl 2>/dev/null
[ -d /tmp/fa ] || $site /tmp/fa .device/fa-whl/*.whl 2>/dev/null
[ -d /tmp/tools ] || $site /tmp/tools $(ls .device/tools/*.whl | grep -v typing_extensions) 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u

tests() {  # one process per file: a file's CUDA state never leaks into the next
  for f in "$@"; do
    SHARD_TEST_DEVICE=cuda PYTHONPATH=/tmp/site:/tmp/tools:$PWD timeout 120 \
      python3 -m pytest -q -x "$f" 2>&1 | tail -3
  done
}

case $part in
  serving)
    # a separate Triton cache for the kernel tests, so that the server starts cold
    TRITON_CACHE_DIR=/tmp/tc-tests SHARD_TEST_DEVICE=cuda PYTHONPATH=/tmp/site:/tmp/tools:$PWD \
      timeout 60 python3 -m pytest -q -x tests/kernels/test_fp8_tuning.py 2>&1 | tail -3
    timeout 480 python3 -m benchmarks.serving.gpu_serving --tokenizer .device/tokenizer \
      --extra-site /tmp/fa --our-defaults --fp8 --latency-requests 32 --skip-hf \
      --checkpoint-dir /tmp/ckpt --nano-vllm .device/peers/nano-vllm \
      --nano-vllm-runner .device/peers/nano_vllm_bench.py --log-dir "$out/logs" \
      --out "$out/gpu-serving.md" > "$out/serving.txt" 2>&1
    echo "gpu_serving rc=$?"
    tail -60 "$out/serving.txt"
    grep -h "fp8 products of\|compiled while serving\|tuned .* product shapes" "$out"/logs/*.log | cut -c1-400
    ;;
  speculative)
    timeout 300 python3 -m benchmarks.steps.speculative_verify --gemm-tuning off \
      --acceptance ngram/grounded=0.67 ngram/chat=0.57 --out "$out/speculative-gpu.md" \
      > "$out/speculative.txt" 2>&1
    echo "speculative_verify rc=$?"
    tail -40 "$out/speculative.txt"
    timeout 50 python3 -m benchmarks.kernels.fp8_activations --rows 1 8 64 256 4096 \
      --hidden 4096 --intermediate 14336 > "$out/fp8-activations.txt" 2>&1
    tail -20 "$out/fp8-activations.txt"
    # a 1-layer draft (0.62 B parameters, inside the 0.5-1 B the targets name)
    timeout 220 python3 -m benchmarks.steps.speculative_verify --gemm-tuning off \
      --draft-layers 1 --batch 1 32 --lookahead 3 4 --acceptance ngram/grounded=0.67 \
      --out "$out/speculative-gpu-draft1.md" > "$out/speculative-draft1.txt" 2>&1
    echo "speculative_verify --draft-layers 1 rc=$?"
    tail -20 "$out/speculative-draft1.txt"
    ;;
  tests)
    tests tests/kernels/test_skinny_gemm.py tests/kernels/test_fp8_activations.py \
      tests/kernels/test_fp8_kv.py tests/unit/shard/test_fp8_kv_cache.py \
      tests/unit/shard/test_speculative_step.py tests/unit/shard/test_speculative_draft.py \
      tests/kernels/test_verify_rows.py
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
date -u
