#!/bin/bash
# Fill .device/ (ignored by git) with what benchmarks/serving/gpu_serving.py needs on a GPU machine
# without network access, and print the command to run there with .device carried along:
#   .device/whl/        the server's wheels beyond the machine's image (fastapi, uvicorn, ...)
#   .device/fa-whl/     the flash-attn wheel built for that machine
#   .device/peers/      nano-vllm and its runner nano_vllm_bench.py
#   .device/tokenizer/  tokenizer files (and config.json, for the BOS/EOS ids) of the default model
#   .device/whl/ also gets the project's dependencies that image lacks (llguidance, jsonschema,
#                httptools)
#   .device/tools/      py-spy (benchmarks/serving/gpu_profile.sh) and pytest, to run tests/kernels there
# Usage, from anywhere: bash benchmarks/serving/gpu_prepare.sh [SHARED_DIR]
# SHARED_DIR (default: ../shared beside the checkout) holds gpu/server-wheels.sh,
# gpu/wheels/flash_attn-*.whl and peers/.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
shared=$(cd "${1:-$root/../shared}" && pwd)
cd "$root"
model="${SHARDSERVE_CACHE_DIR:-$HOME/.cache/shardserve}/models/SmolLM2-135M-Instruct"
limit_mib=64

git check-ignore -q .device/whl/x.whl || { echo "error: .device/ is not ignored by git" >&2; exit 1; }
rm -rf .device/whl .device/fa-whl .device/peers .device/tokenizer .device/tools
mkdir -p .device/whl .device/fa-whl .device/tokenizer .device/tools

bash "$shared/gpu/server-wheels.sh" .device/whl >/dev/null
# Python 3.12 on x86_64 there (GPU.md); llguidance's wheels need glibc 2.31 or newer.
for_gpu=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64
         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${for_gpu[@]}" -d .device/whl "llguidance>=1.9,<2" jsonschema \
  "httptools>=0.6"
python3 -m pip download -q "${for_gpu[@]}" -d .device/tools py-spy pytest pytest-asyncio uvloop \
  pytest-timeout
ls "$shared"/gpu/wheels/flash_attn-*.whl >/dev/null
cp "$shared"/gpu/wheels/flash_attn-*.whl .device/fa-whl/
cp -r "$shared/peers" .device/peers
find .device/peers -name __pycache__ -prune -exec rm -rf {} +
test -f "$model/tokenizer.json" || { echo "error: no tokenizer in $model (run: shardserve prepare)" >&2; exit 1; }
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja config.json; do
  if [ -f "$model/$f" ]; then cp "$model/$f" .device/tokenizer/; fi
done

mib=$(du -sm .device | cut -f1)
echo "== .device: ${mib} MiB (limit ${limit_mib})"
du -sh .device/*
if [ "$mib" -ge "$limit_mib" ]; then echo "error: .device is over ${limit_mib} MiB" >&2; exit 1; fi

site="python3 -m pip install -q --no-index --no-deps --no-compile --target"
cat <<CMD
== run on the GPU machine with carry [".device"] (benchmarks/serving/gpu_profile.sh profiles instead);
== our server with its default flags beside nano-vllm (about 7 minutes for the 8B model on an H100):
$site /tmp/site .device/whl/*.whl && $site /tmp/fa .device/fa-whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD && python3 -m benchmarks.serving.gpu_serving --tokenizer .device/tokenizer --nano-vllm .device/peers/nano-vllm --nano-vllm-runner .device/peers/nano_vllm_bench.py --extra-site /tmp/fa --our-defaults --latency-requests 32 --skip-hf --checkpoint-dir /tmp/ckpt-gpu-serving --log-dir \$OUT/logs --out \$OUT/gpu-serving.md
CMD
