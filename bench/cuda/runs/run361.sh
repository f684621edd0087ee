#!/usr/bin/env bash
# Session 51: the issue-6 table on the committed code (ada8a78's kernels; the stage of part 49 in
# every launch), in one call: the GPU tests and kernel checks, (a) at the five shapes (with the
# step-form rows "after a norm", part 50), (b) at the five shapes, (c), the 7B end-to-end table and its
# batch-1 step twice more, and the server on the device. The portable builds' tests in a second call
# on the same machine (part p). Each stage is left out once the call has run past its limit.
#   run(command="bash bench/cuda/runs/run361.sh", carry=[".device/bundle.tar.xz"])
#   run(command="bash bench/cuda/runs/run361.sh p", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
part=${1:-main}
L=$OUT/run361$part.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
main() {
  stamp "gpu tests"
  .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|worst|engine:" $OUT/gpu_tests.log | head -20
  stamp "kernel tests"
  .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
  grep -E "^FAIL" /tmp/kt.log | head -20; tail -1 /tmp/kt.log
  stamp "(a) one-row bench"
  .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 8192 8192 28672 8192 > $OUT/bench_a.log 2>&1
  grep -E "copy of|GemmEx|balanced, chain of 20 |balanced, chain of 20, no delta|cuBLAS, chain of 20|after a norm|alone \(1 row\)|after the wait  " $OUT/bench_a.log
  stamp "(b) many-variants bench"
  .device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1
  grep -E "copy of|b: roofline|route, folded, graph of 20 |after a norm|alone \(16 rows\)" $OUT/bench_b.log
  stamp "7B model"
  .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
    --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    /tmp/l7b/base/
  stamp "e2e table"
  .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --out $OUT/e2e.json > /tmp/e2e.log 2>&1; echo "rc $?"
  grep -vE "^v[0-9]|replayed as CUDA" /tmp/e2e.log
  for round in 1 2; do
    echo "batch 1, round $round: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
  left 430 "(c)" || {
    stamp "(c) prefill bench"
    .device/bin/bench_cuda_fused_linear --prefill > $OUT/bench_c.log 2>&1; echo "rc $?"
    grep -E "copy of|c: 512" $OUT/bench_c.log
  }
  left 520 "serve" || {
    stamp "serve"
    BITDELTA_STAGES=serve tools/gpu_run.sh /tmp/serve > /tmp/serve_console.log 2>&1; echo "rc $?"
    grep -vE "^(name|NVIDIA|[0-9]+$|Mem:|total|/dev|overlay)" /tmp/serve_console.log | cut -c1-220 | tail -40
  }
}
portable() {  # the two PTX builds' GPU tests and kernel checks
  local sfx ptx
  for sfx in "" 90; do
    ptx=$root/.device/bin-ptx$sfx
    stamp "portable$sfx gpu tests"
    CUDA_CACHE_PATH=/tmp/ptx$sfx-cache BITDELTA_CLI_PATH=$ptx/bitdelta $ptx/bitdelta_gpu_tests \
      > $OUT/portable${sfx}_gpu_tests.log 2>&1; echo "rc $?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/portable${sfx}_gpu_tests.log | head -10
    stamp "portable$sfx kernel tests"
    CUDA_CACHE_PATH=/tmp/ptx$sfx-cache $ptx/test_cuda_fused_linear > /tmp/portable${sfx}_kt.log 2>&1; echo "rc $?"
    grep -E "^FAIL" /tmp/portable${sfx}_kt.log | head -10; head -1 /tmp/portable${sfx}_kt.log; tail -1 /tmp/portable${sfx}_kt.log
  done
}
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
case $part in
  main) main ;;
  p) portable ;;
  *) echo "run361.sh: no part $part (main, p)"; exit 1 ;;
esac
stamp done
} > $L 2>&1
cat $L
