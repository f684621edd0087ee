#!/usr/bin/env bash
# Session 58: the fused prompt GEMM's W tiles in pairs of blocks (2-block clusters) that share each
# stage's copy of x by TMA multicast (run 399: the fused GEMM's warps wait on their stages' copies,
# long scoreboard 4.69 cycles per instruction against cuBLAS's 2.57, and on the tensor pipe only
# 0.24 against 3.21). The new build's binaries in .device/new.tar.xz: its kernel checks, case (c)
# at the 7B prompt's shapes with the blocks alone and in pairs, its GPU tests, and the 7B TTFT of the
# bundle's build (blocks alone) against the new one (pairs), alternated.
#   run(command="bash bench/cuda/runs/run400.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run400.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 .device/new/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
echo "kernel checks rc $?: $(tail -1 $OUT/kernel_test.log)"; grep -m5 FAIL $OUT/kernel_test.log
grep -E "pairs|alone" $OUT/kernel_test.log | head -3
timeout 150 .device/new/bench_cuda_fused_linear --prefill 12288 4096 22016 4096 4096 11008 4096 4096 > $OUT/bench_c.log 2>&1
echo "bench (c) rc $?"
grep -E "cuBLAS GemmEx|fused GEMM" $OUT/bench_c.log | grep -v portable | cut -c1-150
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for b in bin new; do
    [ $(( $(date +%s) - t0 )) -gt 470 ] && { echo "left out: $b round $round"; continue; }
    echo "== $b round $round"
    timeout 90 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 > $OUT/e2e_${b}_$round.log 2>&1
    grep -A17 "TTFT of" $OUT/e2e_${b}_$round.log | head -18
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
timeout 100 .device/new/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "GPU tests rc $?"; grep -E "^\[  (FAILED|PASSED) |tests ran" $OUT/gpu_tests.log | head
date -u
} > $L 2>&1
rm -f $OUT/e2e_*_2.log
cat $L
