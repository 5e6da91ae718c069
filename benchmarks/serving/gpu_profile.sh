#!/bin/bash
# On the GPU machine (after benchmarks/serving/gpu_prepare.sh here, with .device carried): run the
# GPU kernel tests, then serve one workload of benchmarks/serving/gpu_serving.py (ours only) and,
# once WAIT_RUNNING requests run, record the router's and the shard's Python stacks with
# py-spy (raw collapsed stacks, idle samples included, so busy time can be told from
# waiting). Everything lands in $OUT: kernels.log, bench.log, serving.md, router.txt,
# shard.txt.
#   WORKLOAD=decode_heavy SERVER_ARGS="--steps-in-flight 2" bash benchmarks/serving/gpu_profile.sh
# KERNELS=0 skips the kernel tests (e.g. for a second workload in the same session).
set -uo pipefail
workload=${WORKLOAD:-decode_heavy}
wait_running=${WAIT_RUNNING:-200}
seconds=${SECONDS_PROFILED:-6}
port=${PORT:-8777}
site="python3 -m pip install -q --no-index --no-deps --no-compile --target"
$site /tmp/site .device/whl/*.whl && $site /tmp/tools .device/tools/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/tools:$PWD
if [ "${KERNELS:-1}" != 0 ]; then
  python3 -m pytest -p no:cacheprovider -q tests/kernels > "$OUT/kernels.log" 2>&1
  tail -3 "$OUT/kernels.log"
fi
python3 -m benchmarks.serving.gpu_serving --tokenizer .device/tokenizer --skip-hf \
  --workloads "$workload" --block-size 16 --max-batch-size 512 --port "$port" \
  --server-args "${SERVER_ARGS:-}" --checkpoint-dir /tmp/ckpt --log-dir "$OUT/logs" \
  --out "$OUT/serving.md" > "$OUT/bench.log" 2>&1 &
bench=$!
running=0
for _ in $(seq 1 1200); do
  running=$(curl -s "localhost:$port/metrics" | awk '/^shardserve_running_batch_size /{print int($2)}')
  [ "${running:-0}" -ge "$wait_running" ] && break
  kill -0 "$bench" 2>/dev/null || break
  sleep 0.5
done
echo "running requests when profiling began: ${running:-0}"
router=$(pgrep -f "router.cli launch" | head -1)
shard=$(pgrep -f "shard.server" | head -1)
if [ -n "$router" ] && [ -n "$shard" ]; then
  /tmp/tools/bin/py-spy record --idle --rate 250 --duration "$seconds" --format raw \
    -o "$OUT/router.txt" --pid "$router" > "$OUT/py-spy-router.log" 2>&1 &
  profiling=$!
  /tmp/tools/bin/py-spy record --idle --threads --rate 250 --duration "$seconds" \
    --format raw -o "$OUT/shard.txt" --pid "$shard" > "$OUT/py-spy-shard.log" 2>&1
  wait "$profiling"
fi
wait "$bench"
tail -20 "$OUT/bench.log"
cat "$OUT/serving.md"
