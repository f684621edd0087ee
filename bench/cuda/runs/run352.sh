#!/usr/bin/env bash
# Session 48: the one-row forms made default (b77602b), and the pending route of 3-32 rows of several
# variants (bench/cuda/pending/route_xq_pairs_stream_base.patch: x quantized in pairs by the norms
# and SwiGLU for the delta terms; the streaming kernel as the base at N <= 4096; switches
# BITDELTA_AB_ROUTE_XQ, BITDELTA_AB_STREAM_BASE, on by default). The bundle must be built with the
# patch applied (tools/device_bundle.sh), and .device/ab.tar.xz must hold .device/ab/bench_gpu_e2e_ab:
# bench_gpu_e2e built at 6215809 with the session-46 patch applied (its switches BITDELTA_AB_EARLY_W
# and BITDELTA_AB_PRODUCER_XQ; both off = the code before b77602b). Checked and measured in three
# calls on one warm machine (each under the 600 s a call may take), or in one (`all`):
#   run(command="bash bench/cuda/runs/run352.sh a", carry=[".device/bundle.tar.xz", ".device/ab.tar.xz"])
#   run(command="bash bench/cuda/runs/run352.sh b", carry=[".device/bundle.tar.xz"])
#   run(command="bash bench/cuda/runs/run352.sh c", carry=[".device/bundle.tar.xz"])
# t: the tests alone (part a's and c's), for a call on an H100 while no H200 is lent.
# all: one call of the most needed (after starts were refused for an hour): the normal build's
#    tests, both benches, the 7B batch-1 A/B, the mixed A/B (on/off at batch 16 and 32, twice; the
#    two switches apart at 32 once) and the end-to-end table, each stage left out past its time.
# a: the GPU tests and kernel checks of the normal build; both kernel benches (one row at the five
#    shapes; 16 rows of 16 variants); the 7B model made and its batch-1 steps in three forms,
#    alternated twice: this build (early W and the producers' xq, the default now), and the
#    session-46 A/B binary (.device/ab.tar.xz: bench_gpu_e2e built with the pending patch and its
#    switches) with both switches off (the code before b77602b) and both on (the same forms as
#    this build, to show the two binaries agree).
# b: the 7B mixed steps at batch 16 and 32 with the route's two switches in their four settings,
#    alternated twice; the issue's end-to-end table on this build (both on).
# c: the two PTX builds' GPU tests and kernel checks.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
grep -qa BITDELTA_AB_ROUTE_XQ .device/bin/bench_gpu_e2e ||
  { echo "run352.sh: the bundle was not built with route_xq_pairs_stream_base.patch applied"; exit 1; }
part=${1:-a}
L=$OUT/run352$part.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
make7b() {
  [ -f /tmp/l7b/deltas/v13.bitdelta ] && return
  .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
    --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || { tail -5 /tmp/ms.log; }
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    /tmp/l7b/base/
}
# Each stage is left out once the call has run past its limit (seconds), so that the call ends
# with its logs before the 600 s it may take.
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
tests() {  # the normal build's GPU tests and kernel checks
  stamp "gpu tests"
  BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Quantized|FewRows" $OUT/gpu_tests.log | head -20
  stamp "kernel tests"
  .device/bin/test_cuda_fused_linear > $OUT/kt.log 2>&1; echo "rc $?"
  grep -E "^FAIL" $OUT/kt.log | head -20; grep -cE "bal. xq|x quantized before: the same" $OUT/kt.log; tail -1 $OUT/kt.log
}
benches() {
  stamp "bench many-variants"
  .device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1; echo "rc $?"
  grep -E "b: roofline|b: floor|AB route|x quantized before|route.s" $OUT/bench_b.log
  stamp "bench one-row"
  .device/bin/bench_cuda_fused_linear --one-row > $OUT/bench_a.log 2>&1; echo "rc $?"
  grep -E "chain of 20|x quantized before|GemmEx" $OUT/bench_a.log
}
batch1() {  # limit, forms: new (this build), old / on (the A/B binary, its switches off / on)
  local limit=$1 round form b e p
  shift
  (cd .device && tar -xJf ab.tar.xz) || return 1
  make7b
  stamp "7B batch 1: $*"
  for round in 1 2; do
    for form in "$@"; do
      left $limit "batch 1 round $round $form" && continue
      case $form in
        new) b=.device/bin/bench_gpu_e2e; e=0; p=0 ;;
        old) b=.device/ab/bench_gpu_e2e_ab; e=0; p=0 ;;
        on) b=.device/ab/bench_gpu_e2e_ab; e=1; p=1 ;;
      esac
      echo "round $round $form: $(BITDELTA_AB_EARLY_W=$e BITDELTA_AB_PRODUCER_XQ=$p \
        $b /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
    done
  done
}
mixed() {  # limit, then the settings (route xq, stream base) of each round, rounds apart by ","
  local limit=$1 round=0 set B f
  make7b
  stamp "7B mixed: route xq x stream base"
  IFS=, read -ra rounds <<< "$2"
  for set in "${rounds[@]}"; do
    round=$((round + 1))
    for B in 16 32; do
      for f in $set; do
        left $limit "mixed round $round B=$B $f" && continue
        echo "round $round B=$B xq=${f:0:1} stream_base=${f:1:1}: $(BITDELTA_AB_ROUTE_XQ=${f:0:1} \
          BITDELTA_AB_STREAM_BASE=${f:1:1} .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --batch $B \
          --profile-case mixed 2>&1 | grep -E '^batch' | tr '\n' ' ')"
      done
    done
  done
}
table() {
  make7b
  stamp "e2e table"
  left $1 "e2e table" && return
  .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --out $OUT/e2e.json > $OUT/e2e.log 2>&1; echo "rc $?"
  grep -vE "^v[0-9]|replayed as CUDA" $OUT/e2e.log
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
    CUDA_CACHE_PATH=/tmp/ptx$sfx-cache $ptx/test_cuda_fused_linear > $OUT/portable${sfx}_kt.log 2>&1; echo "rc $?"
    grep -E "^FAIL" $OUT/portable${sfx}_kt.log | head -10; head -1 $OUT/portable${sfx}_kt.log; tail -1 $OUT/portable${sfx}_kt.log
  done
}
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
case $part in
  a) [ -n "${BITDELTA_SKIP_TESTS:-}" ] || tests; benches; batch1 540 new old on ;;
  b) mixed 380 "11 00 10 01,11 00 10 01"; table 600 ;;
  c) portable ;;
  t) tests; portable ;;
  all) tests; benches; batch1 290 new old; mixed 390 "11 00,11 00,10 01"; table 420 ;;
  *) echo "run352.sh: no part $part (a, b, c, t, all)"; exit 1 ;;
esac
stamp done
} > $L 2>&1
tail -c 11000 $L
