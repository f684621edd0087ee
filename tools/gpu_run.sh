#!/usr/bin/env bash
# On the GPU machine: runs the gpu-labelled tests, a server smoke test on the device and the
# benchmarks, writing logs and results under OUT_DIR.  Usage: tools/gpu_run.sh OUT_DIR
#
# Binaries: .device/bin (made by tools/device_bundle.sh on the CPU machine, with the Debian libraries
# the GPU machine lacks in .device/lib, and carried as .device/bundle.tar.xz, unpacked here), since
# that machine has no package registry for our -dev packages. Without them, the CUDA kernels alone are
# built there from source (-DBITDELTA_CUDA_ONLY=ON) and only their test and benchmark run.
#
# BITDELTA_STAGES (default "tests serve e2e"): any of
#   tests    bitdelta_gpu_tests (ops, model vs fixtures and CPU, engine tiers, CLI) + test_cuda_fused_linear;
#            and the byte-level BPE fixture (tests/fixtures/bpe) against the `tokenizers` package,
#            which this machine has and the CPU machine lacks
#   serve    `bitdelta serve --device cuda` on the demo family: one request per variant, `bench serve`, /metrics
#   kernels  bench_cuda_fused_linear (the linear-layer table of issue 6) and bench_gpu_attention
#   e2e      a synthetic Llama-2-7B-shaped model with 14 deltas (made here, in /tmp) and bench_gpu_e2e
#   portable the GPU tests again on the engine built with one PTX alone (BITDELTA_CUDA_PTX_ONLY):
#            .device/bin-ptx (compute_80: what 8.x GPUs run, as sm_80 code) and .device/bin-ptx90
#            (compute_90: what GPUs after Hopper run). The driver compiles it for this GPU, which then
#            runs without the sm_90a kernels, and with programmatic launch only from the compute_90
#            PTX (src/backend/cuda/code_arch.h); after e2e also bench_gpu_e2e on each, on its model
#            (BITDELTA_PORTABLE_E2E_ARGS, default --decode 16)
set -uo pipefail
out=${1:?usage: tools/gpu_run.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
stages=${BITDELTA_STAGES:-tests serve e2e}
has() { [[ " $stages " == *" $1 "* ]]; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  nproc
  free -g | head -2
  df -h /tmp | tail -1
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
status=0

if [ -f .device/bundle.tar.xz ]; then  # (always: a machine kept warm may hold an older .device/bin)
  tar -C .device -xJf .device/bundle.tar.xz || { echo "gpu_run.sh: cannot unpack .device/bundle.tar.xz"; exit 1; }
fi
if [ ! -x .device/bin/bitdelta ]; then
  echo "no .device/bin: building the CUDA kernels alone"
  build=build-gpu
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBITDELTA_CUDA_ONLY=ON \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_CUDA_FLAGS="--threads=0" >"$out/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" >>"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  "$build/src/backend/cuda/test_cuda_fused_linear" >"$out/test.log" 2>&1 || status=1
  tail -3 "$out/test.log"
  "$build/src/backend/cuda/bench_cuda_fused_linear" >"$out/bench.log" 2>&1 || status=1
  cat "$out/bench.log"
  exit $status
fi

bin=$root/.device/bin
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export BITDELTA_SOURCE_DIR=$root BITDELTA_CLI_PATH=$bin/bitdelta

if has tests; then
  echo "== tests"
  "$bin/bitdelta_gpu_tests" 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |worst|engine:|^  |tests ran" || true
  grep -q "^\[  PASSED  \]" "$out/gpu_tests.log" && ! grep -q "^\[  FAILED  \]" "$out/gpu_tests.log" || status=1
  "$bin/test_cuda_fused_linear" >"$out/kernel_test.log" 2>&1 || status=1
  tail -2 "$out/kernel_test.log"
  python3 tools/bpe_fixture/make_fixture.py tests/fixtures/bpe --check >"$out/bpe_check.log" 2>&1 ||
    status=1
  tail -3 "$out/bpe_check.log"
fi

if has serve; then
  echo "== serve --device cuda"
  port=18080
  "$bin/bitdelta" serve --device cuda --port $port --cache-dir /tmp/bitdelta-demo >"$out/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.5; done
  for m in base coder math writer legal; do
    r=$(curl -s localhost:$port/v1/completions -H 'Content-Type: application/json' \
      -d "{\"model\": \"$m\", \"prompt\": \"def add(a, b):\", \"max_tokens\": 16, \"temperature\": 0}")
    echo "$m: $r" | tee -a "$out/serve.log" | cut -c1-200
    echo "$r" | grep -q '"text"' || status=1
  done
  # Throughput on the device: the demo family's five models mixed, 32 requests in flight.
  "$bin/bitdelta" bench serve --url http://127.0.0.1:$port --variants base=1,coder=1,math=1,writer=1,legal=1 \
    --num-requests 400 --concurrency 32 --input-len 64 --output-len 64 2>&1 | tee -a "$out/serve.log" | tail -25
  curl -s localhost:$port/metrics | grep -E "^bitdelta_(requests_total|delta_cache_(loads|host_hits)_total)" | tee -a "$out/serve.log"
  kill $pid
  wait $pid 2>/dev/null
fi

if has kernels; then
  echo "== kernels"
  "$bin/bench_cuda_fused_linear" >"$out/kernel_bench.log" 2>&1 || status=1
  cat "$out/kernel_bench.log"
  if [ -x "$bin/bench_gpu_attention" ]; then  # (a bundle may leave it out to stay under the 64 MiB a run carries)
    "$bin/bench_gpu_attention" >"$out/attention_bench.log" 2>&1 || status=1
    cat "$out/attention_bench.log"
  fi
fi

if has e2e; then
  echo "== e2e: synthetic Llama-2-7B shape, 14 deltas"
  data=/tmp/l7b
  if [ ! -f $data/deltas/v13.bitdelta ]; then
    t0=$(date +%s)
    # (its log stays in /tmp unless it fails: the device tool returns at most 8 files, and with all
    # four stages the others are 8)
    "$bin/make_synthetic" $data --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
      --tie 0 --shards 3 --finetune 0 --deltas 14 >/tmp/make_synthetic.log 2>&1 ||
      { cp /tmp/make_synthetic.log "$out/"; cat /tmp/make_synthetic.log; exit 1; }
    echo "made in $(( $(date +%s) - t0 )) s"
  fi
  # The engine needs a tokenizer: the demo family's (its ids are a subset of this vocabulary).
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    $data/base/ 2>/dev/null
  "$bin/bench_gpu_e2e" $data ${BITDELTA_E2E_ARGS:-} --out "$out/e2e.json" 2>&1 | tee "$out/e2e.log" || status=1
fi

if has portable; then
  for arch in 80 90; do
    echo "== portable: the compute_$arch PTX build, compiled by the driver for this GPU"
    sfx=$([ $arch = 80 ] || echo $arch)
    ptx=$root/.device/bin-ptx$sfx
    [ -x "$ptx/bitdelta_gpu_tests" ] || { echo "no .device/bin-ptx$sfx: make the bundle again (tools/device_bundle.sh)"; exit 1; }
    export CUDA_CACHE_PATH=/tmp/bitdelta-ptx$sfx-cache BITDELTA_CLI_PATH=$ptx/bitdelta
    t0=$(date +%s)
    "$ptx/bitdelta_gpu_tests" 2>&1 | tee "$out/portable${sfx}_tests.log" |
      grep -E "^\[  (FAILED|PASSED|SKIPPED) |runs code|tests ran" || true
    grep -q "^\[  PASSED  \]" "$out/portable${sfx}_tests.log" && ! grep -q "^\[  FAILED  \]" "$out/portable${sfx}_tests.log" ||
      status=1
    "$ptx/test_cuda_fused_linear" >"$out/portable${sfx}_kernel_test.log" 2>&1 || status=1
    head -1 "$out/portable${sfx}_kernel_test.log"
    tail -1 "$out/portable${sfx}_kernel_test.log"
    echo "portable tests (compute_$arch): $(( $(date +%s) - t0 )) s, the driver's compilation included"
    if has e2e; then
      "$ptx/bench_gpu_e2e" /tmp/l7b ${BITDELTA_PORTABLE_E2E_ARGS:---decode 16} 2>&1 |
        tee "$out/portable${sfx}_e2e.log" || status=1
    fi
  done
  export BITDELTA_CLI_PATH=$bin/bitdelta
fi
exit $status
