#!/usr/bin/env bash
# Session 59: the two-ring fused GEMM again (run405_two_rings.patch: W's slot now released after the
# stage's wgmma issue, which waits for the fragments, so after the ldmatrix reads). On an H200 first
# run392.sh (the issue's table for the committed code). Then on any card: the new build's kernel
# checks; if all pass, case (c) at the 7B's qkv and 4096 x 4096 for the bundle's build and the new
# one, the 7B TTFT of both alternated, and the new build's GPU tests.
#   run(command="bash bench/cuda/runs/run406.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run406.log
{
date -u; echo "$card"
timeout 100 .device/new/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
rc=$?
echo "kernel checks rc $rc: $(tail -1 $OUT/kernel_test.log)"; grep -m5 FAIL $OUT/kernel_test.log
if [ $rc -eq 0 ]; then
  for b in new bin; do
    timeout 70 .device/$b/bench_cuda_fused_linear --prefill 12288 4096 4096 4096 > $OUT/bench_c_$b.log 2>&1
    echo "== $b: bench (c) rc $?"
    grep -E "cuBLAS GemmEx|fused GEMM" $OUT/bench_c_$b.log | grep "c: 512" | grep -vE "portable|tile/block" | cut -c1-150
  done
  echo "-- $(( $(date +%s) - t0 )) s"
  [ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
    --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    /tmp/l7b/base/
  for round in 1 2; do
    for b in new bin; do
      [ $(( $(date +%s) - t0 )) -gt 480 ] && { echo "left out: $b round $round"; continue; }
      echo "== $b round $round: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
        grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
    done
  done
  if [ $(( $(date +%s) - t0 )) -lt 450 ]; then
    (BITDELTA_CLI_PATH=$root/.device/bin/bitdelta timeout 120 $root/.device/new/bitdelta_gpu_tests > $OUT/gpu_tests_new.log 2>&1)
    echo "new GPU tests rc $?: $(tail -2 $OUT/gpu_tests_new.log | tr '\n' ' ')"
  fi
fi
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
