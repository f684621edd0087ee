#!/usr/bin/env bash
# Written in session 42 (no device lent then), for the next session's first device call, with
# terms_zeroed_by_quantize.patch and (session 43) cold_load_ab.patch applied and the bundle made
# (tools/device_bundle.sh):
#   run(command="bash bench/cuda/pending/run_ab.sh", carry=[".device/bundle.tar.xz"])
# The GPU tests on the three builds, the kernel checks (normal and compute_80 builds), the (b) and
# (a) benches with the patch's new forms (the A/B of the terms' zeroing in one process, each branch
# of the route alone, the streaming kernel as the route's base, the chained read floors), and the 7B
# mixed step at batch 8 and 32 with the zeroing A/B alternated twice; each of those eight processes
# also makes a cold load of one delta, printed with the disk floor measured beside it: session 43's
# copy into pinned memory behind the disk read (SequentialPager) in the first of every two, the
# copy after the whole read (BITDELTA_AB_COLD_SERIAL=1) in the second. About 6-7 minutes: an
# estimate from the stages' times in earlier runs.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run_ab.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
for b in bin bin-ptx bin-ptx90; do
  stamp "gpu tests $b"
  CUDA_CACHE_PATH=/tmp/cc-$b BITDELTA_CLI_PATH=$root/.device/$b/bitdelta .device/$b/bitdelta_gpu_tests 2>&1 |
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" | head -20
done
for b in bin bin-ptx; do
  stamp "kernel tests $b"
  CUDA_CACHE_PATH=/tmp/cc-$b .device/$b/test_cuda_fused_linear > $OUT/kt_$b.log 2>&1; echo "rc $?"
  grep -E "^FAIL" $OUT/kt_$b.log | head -20; grep -E "zeroing|beside" $OUT/kt_$b.log | head -6
  grep -c "beside" $OUT/kt_$b.log; tail -1 $OUT/kt_$b.log
done
stamp "bench many-variants"
.device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1; echo "rc $?"
grep -E "b: roofline|b: floor|terms|AB |route|stream kernel base" $OUT/bench_b.log
stamp "bench one-row"
.device/bin/bench_cuda_fused_linear --one-row > $OUT/bench_a.log 2>&1; echo "rc $?"
grep -E "a: floor|balanced, chain|no delta|GemmEx|balanced grid \(default\)|alternating" $OUT/bench_a.log
stamp "7B"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || { tail -5 /tmp/ms.log; }
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json /tmp/l7b/base/
for round in 1 2; do
  for ab in memset quantize; do
    for B in 8 32; do
      if [ $ab = memset ]; then export BITDELTA_AB_MEMSET=1; else unset BITDELTA_AB_MEMSET; fi
      if [ $B = 32 ]; then export BITDELTA_AB_COLD_SERIAL=1; cold=serial; else unset BITDELTA_AB_COLD_SERIAL; cold=behind; fi
      echo "round $round $ab B=$B cold=$cold: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --batch $B --profile-case mixed 2>&1 |
        grep -E '^batch|^cold load|floor: disk' | tr '\n' ' ')"
    done
  done
done
unset BITDELTA_AB_MEMSET BITDELTA_AB_COLD_SERIAL
stamp done
} > $L 2>&1
tail -c 11000 $L
