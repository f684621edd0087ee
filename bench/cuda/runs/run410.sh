#!/usr/bin/env bash
# Session 59: the build to commit (F: two rings, x's leading by 3 stages, W's taking the rest; the
# code of run 409's T0 with its comments reworded) against the bundle's (bin): F's kernel checks and
# GPU tests, case (c) at the 7B's qkv and 4096 x 4096, and the 7B TTFT of prompts of 128 and 64
# tokens (the 128 x 128 and 64 x 64 tiles, whose rings changed too: x 5 stages and W 7 and 19, from
# one ring of 6 and 12), alternated in two rounds.
#   run(command="bash bench/cuda/runs/run410.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run410.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 .device/new/F/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
echo "F kernel checks rc $?: $(tail -1 $OUT/kernel_test.log)"; grep -m3 FAIL $OUT/kernel_test.log
(BITDELTA_CLI_PATH=$root/.device/bin/bitdelta timeout 60 $root/.device/new/F/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1)
echo "F GPU tests rc $?: $(tail -2 $OUT/gpu_tests.log | tr '\n' ' ')"
for b in new/F bin; do
  timeout 70 .device/$b/bench_cuda_fused_linear --prefill 12288 4096 4096 4096 > $OUT/bench_c_${b//\//_}.log 2>&1
  echo "== $b: bench (c) rc $?"
  grep -E "cuBLAS GemmEx|the engine's choice" $OUT/bench_c_${b//\//_}.log | grep "c: 512" | cut -c1-150
done
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for p in 128 64; do
    for b in new/F bin; do
      [ $(( $(date +%s) - t0 )) -gt 500 ] && { echo "left out: $b prompt $p round $round"; continue; }
      echo "== $b prompt $p round $round: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --prompt $p --decode 4 --batch 32 \
        --requests 8 2>&1 | grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
    done
  done
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
