#!/usr/bin/env bash
# Session 60, prepared for the next session (not run): the K effect of runs 420-421 (the delta costs
# 5-14% where K is a power of two, up to 46% elsewhere, except in the two-ring 64 x 256 tile): two
# remedies, and a test of what bounds the 64 x 256 tile, against the bundle (bin, HEAD):
#   X3, X4: the 128 x 128 tile (prompts of 65-128 rows) with a deeper W ring: HEAD has x 8 stages
#     (lead 6), W 5; X3 (runs/run422_x3_128x128.patch) x 5 (lead 3), W 8; X4 (the same patch with
#     `kSets - 1 + 4`) x 6 (lead 4), W 7;
#   S (runs/run422_signs512.patch): every tile copies each row group's 512 bytes of signs whole per
#     stage (one contiguous run; HEAD copies eight 32-byte pieces, half of it), to test whether the
#     signs' small strided pieces are what comes late.
#   KX (runs/run422_knock_half_x.patch; timing only, its sums are wrong): each x stage copies half of
#     its rows, to test whether x's bytes from L2 bound the 64 x 256 tile (run 417: down's consumers
#     wait on x in 15% of samples, x's ring full; 721 MB of x per launch by arithmetic).
# On an H200, run392.sh first (the issue's table). Then: kernel checks of X3, X4, S; case (c) with x
# just written (--prefill-fresh-x) at N = 4096, K = 4096, 8192, 11008, 14336, and --prefill-rows 128 at
# o's, down's, qkv's and gate/up's shapes (the engine's choice there is 128 x 128), for bin, X3, X4,
# S; KX against bin, (c) with x just written at 4096 x 11008, 4096^2, 12288 x 4096, two rounds; the 7B
# TTFT at 128-token prompts (bin, X3, X4, S) and 512-token prompts (bin and S), two rounds.
# .device/new.tar.xz: X3/, X4/, S/ (bench_cuda_fused_linear, test_cuda_fused_linear, bench_gpu_e2e each),
# KX/ (bench_cuda_fused_linear only):
# for each, git apply its patch (X4: then edit `kSets - 1 + 3` into 4), build those targets, strip
# them into /tmp/newbin/<name>, git checkout the file; tar -C /tmp/newbin -cf - . | xz -T2 -9 >
# .device/new.tar.xz.
#   run(command="bash bench/cuda/runs/run422.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run422.log
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out: $2"; return 0; }; return 1; }
{
date -u; echo "$card"
for b in X3 X4 S; do
  left 300 "kernel checks of $b" && continue
  timeout 100 .device/new/$b/test_cuda_fused_linear > /tmp/kt.log 2>&1
  echo "$b kernel checks rc $?: $(tail -1 /tmp/kt.log)"; grep -m3 FAIL /tmp/kt.log
done
for b in bin new/X3 new/X4 new/S; do
  left 400 "(c) of $b" && continue
  timeout 60 .device/$b/bench_cuda_fused_linear --prefill-fresh-x 4096 4096 4096 8192 4096 11008 4096 14336 \
    > /tmp/c.log 2>&1
  echo "== $b: (c) fresh x rc $?"
  grep -E "cuBLAS GemmEx [0-9]|128x128 tile/block|engine's choice" /tmp/c.log | grep "c: 512" | cut -c1-150
  timeout 60 .device/$b/bench_cuda_fused_linear --prefill-rows 128 4096 4096 4096 11008 12288 4096 22016 4096 \
    > /tmp/r.log 2>&1
  echo "== $b: 128 rows rc $?"
  grep -E "cuBLAS GemmEx [0-9]|cuBLAS GemmEx, x just|the engine's choice" /tmp/r.log | grep "c: 128" | cut -c1-150
done
for round in 1 2; do
  for b in bin new/KX; do
    left 430 "KX's (c) round $round" && continue
    timeout 60 .device/$b/bench_cuda_fused_linear --prefill-fresh-x 4096 11008 4096 4096 12288 4096 > /tmp/c.log 2>&1
    echo "== $b round $round: (c) fresh x rc $?"
    grep -E "cuBLAS GemmEx [0-9]|64x256 persistent|engine's choice" /tmp/c.log | grep "c: 512" | cut -c1-150
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for bp in bin:128 new/X3:128 new/X4:128 new/S:128 bin:512 new/S:512; do
    b=${bp%:*} p=${bp#*:}
    left 550 "TTFT $p of $b round $round" && continue
    echo "== $b TTFT $p round $round: $(timeout 40 .device/$b/bench_gpu_e2e /tmp/l7b --prompt $p --decode 4 --batch 32 \
      --requests 8 2>&1 | grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
