#!/usr/bin/env bash
# Session 59: the two rings with their depths from one rule (n2: equal lead for both rings, W the slots
# left over: 64x64 13 x / 12 W stages, 64x256 5 / 6, 128x256 4 / 5, 128x176 5 / 6, 128x128 7 / 5)
# against run 406's x ring of 4 (new) and the bundle's one ring (bin): n2's kernel checks; if they
# pass, case (c) at the 7B's qkv and 4096 x 4096 for all three, the 7B TTFT of all three alternated,
# and n2's GPU tests. .device/new.tar.xz holds new/ and new/n2/.
#   run(command="bash bench/cuda/runs/run407.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run407.log
{
date -u; echo "$card"
timeout 100 .device/new/n2/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
rc=$?
echo "kernel checks rc $rc: $(tail -1 $OUT/kernel_test.log)"; grep -m5 FAIL $OUT/kernel_test.log
if [ $rc -eq 0 ]; then
  for b in new/n2 new bin; do
    timeout 70 .device/$b/bench_cuda_fused_linear --prefill 12288 4096 4096 4096 > $OUT/bench_c_${b//\//_}.log 2>&1
    echo "== $b: bench (c) rc $?"
    grep -E "cuBLAS GemmEx|fused GEMM" $OUT/bench_c_${b//\//_}.log | grep "c: 512" | grep -vE "portable|tile/block" |
      cut -c1-150
  done
  echo "-- $(( $(date +%s) - t0 )) s"
  [ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
    --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    /tmp/l7b/base/
  for round in 1 2; do
    for b in new/n2 new bin; do
      [ $(( $(date +%s) - t0 )) -gt 500 ] && { echo "left out: $b round $round"; continue; }
      echo "== $b round $round: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
        grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
    done
  done
  if [ $(( $(date +%s) - t0 )) -lt 520 ]; then
    (BITDELTA_CLI_PATH=$root/.device/bin/bitdelta timeout 60 $root/.device/new/n2/bitdelta_gpu_tests \
      > $OUT/gpu_tests_n2.log 2>&1)
    echo "n2 GPU tests rc $?: $(tail -2 $OUT/gpu_tests_n2.log | tr '\n' ' ')"
  fi
fi
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
